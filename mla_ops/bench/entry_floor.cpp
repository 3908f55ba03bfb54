// The entry floor of `mla-ops bench ops` (mla_ops/bench/native.py): what a call from Python costs before
// any kernel work. A kernel that does nothing, registered for twins of the ops' schemas in their own
// namespace, consumes its arguments and returns its first tensor argument for each tensor it must return
// (aliasing outputs: a timing device, never an operator). Registered on CompositeImplicitAutograd, so
// the dispatcher reaches it in one hop from the Python entry: no kernel on the dispatcher can be called
// from Python for less. Compiled when the benchmark first needs it (torch.utils.cpp_extension.load);
// it is not part of the installed extension.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

std::vector<std::unique_ptr<torch::Library>> g_libraries;  // the registrations live as long as these

void do_nothing(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  std::optional<at::Tensor> first;
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(num_arguments); it != stack->end(); ++it) {
    if (it->isTensor()) {
      first = it->toTensor();
      break;
    }
  }
  torch::jit::drop(*stack, num_arguments);
  for (size_t i = 0; i < schema.returns().size(); ++i) {
    TORCH_CHECK(first.has_value(), schema.name(), ": an entry-floor twin needs a tensor argument to return");
    stack->emplace_back(*first);
  }
}

// Serves ops `names` of namespace `ns` (defined beforehand, from Python) with `do_nothing`.
void serve_with_nothing(const std::string& ns, const std::vector<std::string>& names) {
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CompositeImplicitAutograd,
                                                  __FILE__, __LINE__);
  for (const auto& name : names) {
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&do_nothing>());
  }
  g_libraries.push_back(std::move(library));
}

}  // namespace

TORCH_LIBRARY(mla_entry_floor_bench, m) { m.def("serve_with_nothing(str ns, str[] names) -> ()", &serve_with_nothing); }
