// AutogradCPU kernel of the native ops (native_op.h). The inference path skips the op's autograd
// kernel (Python): with grad mode off, or no input requiring a gradient, nothing needs recording.
// Otherwise the op's own Autograd registration (its backward formula, or the refusal of an
// inference-only op) serves the call.
#include "native_op.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>

namespace mla_native {

void autograd_cpu(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(arguments.size());
  if (at::GradMode::is_enabled()) {
    for (auto it = first; it != stack->end(); ++it) {
      if (it->isTensor() && it->toTensor().requires_grad()) {
        op.callBoxedForDispatchKey(c10::DispatchKey::Autograd, *stack);
        return;
      }
    }
  }
  c10::SmallVector<at::Tensor, 2> written;  // what the op writes in place (Tensor(a!) in the schema)
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite() && first[i].isTensor()) written.push_back(first[i].toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  // autograd notices a cache modified after being saved (what ADInplaceOrView does for ATen ops)
  for (auto& t : written) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace mla_native
