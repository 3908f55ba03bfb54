// The routing state of the native ops (native_op.h) and the extension's own operators,
// torch.ops.mla_native.*: what the backend layer (mla_ops/backends/cpu_native.py) sets and asks.
#include "native_op.h"

#include "kernels/kernels.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace mla_native {
namespace {

struct NativeOpRecord {
  std::unique_ptr<NativeOpState> state = std::make_unique<NativeOpState>();
  std::optional<c10::KernelFunction> reasons;
  bool may_refuse = false;
};

std::mutex g_registry_mutex;

std::map<std::string, NativeOpRecord, std::less<>>& registry() {
  static auto* records = new std::map<std::string, NativeOpRecord, std::less<>>();  // lives as long as the kernels
  return *records;
}

NativeOpRecord& record_of(std::string_view name, bool create) {
  std::lock_guard<std::mutex> guard(g_registry_mutex);
  auto& records = registry();
  auto it = records.find(name);
  if (it == records.end()) {
    TORCH_CHECK(create, "mla_native: no native kernel is registered for mla.", name, " (it serves: ", [&] {
      std::string names;
      for (const auto& [known, _] : records) names += (names.empty() ? "" : ", ") + known;
      return names;
    }(), ")");
    it = records.emplace(std::string(name), NativeOpRecord{}).first;
    it->second.state->name = std::string(name);
  }
  return it->second;
}

std::vector<std::string> registered_ops(bool only_those_that_may_refuse) {
  std::lock_guard<std::mutex> guard(g_registry_mutex);
  std::vector<std::string> names;
  for (const auto& [name, record] : registry()) {
    if (record.reasons.has_value() && (!only_those_that_may_refuse || record.may_refuse)) names.push_back(name);
  }
  return names;
}

Route parse_route(std::string_view route) {
  if (route == "native") return Route::kNative;
  if (route == "demanded") return Route::kDemanded;
  if (route == "elsewhere") return Route::kElsewhere;
  TORCH_CHECK(false, "mla_native.set_route: route must be 'native', 'demanded' or 'elsewhere', got '", route, "'");
}

void set_route(std::string_view op, std::string_view route, std::string_view refusal) {
  const Route parsed = parse_route(route);
  NativeOpState& state = *record_of(op, /*create=*/false).state;
  {
    std::lock_guard<std::mutex> guard(g_registry_mutex);
    state.refusal = std::string(refusal);
  }
  state.route.store(static_cast<int>(parsed), std::memory_order_relaxed);
}

// mla_native::reasons(str op, Any[] args) -> str[]: the op's reasons for these arguments (every schema
// argument, in order, defaults filled in by the caller).
void reasons_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const c10::List<c10::IValue> args = torch::jit::pop(*stack).toList();
  const std::string op = torch::jit::pop(*stack).toStringRef();
  NativeOpRecord& record = record_of(op, /*create=*/false);
  const c10::OperatorHandle& handle = record.state->op();
  const auto& schema_arguments = handle.schema().arguments();
  TORCH_CHECK(args.size() == schema_arguments.size(), "mla_native.reasons: mla.", op, " takes ",
              schema_arguments.size(), " arguments, got ", args.size());
  torch::jit::Stack call;
  call.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue value = args.get(i);
    // a Python int where the schema says float (softmax_scale=1): what the op's own argument parsing allows
    if (value.isInt() && schema_arguments[i].type()->kind() == c10::TypeKind::FloatType) {
      value = c10::IValue(static_cast<double>(value.toInt()));
    }
    call.push_back(std::move(value));
  }
  record.reasons->callBoxed(handle, c10::DispatchKeySet(c10::DispatchKey::CPU), &call);
  stack->push_back(std::move(call.back()));
}

Isa parse_isa(std::string_view name) {
  for (int i = 0; i < kNumIsas; ++i) {
    if (kIsaNames[i] == name) return static_cast<Isa>(i);
  }
  TORCH_CHECK(false, "mla_native.set_isa: unknown ISA '", name, "'; choose one of 'default', 'avx2', 'avx512'");
}

std::vector<std::string> runnable_isas() {
  std::vector<std::string> names;
  for (int i = 0; i < kNumIsas; ++i) {
    if (isa_runs_here(static_cast<Isa>(i))) names.emplace_back(kIsaNames[i]);
  }
  return names;
}

}  // namespace

const c10::OperatorHandle& NativeOpState::op() const {
  static std::mutex mutex;
  std::lock_guard<std::mutex> guard(mutex);
  if (!handle_) handle_ = c10::Dispatcher::singleton().findSchemaOrThrow(("mla::" + name).c_str(), "");
  return *handle_;
}

NativeOpState& native_op_state(std::string_view name) { return *record_of(name, /*create=*/true).state; }

void refuse(const NativeOpState& state, const Reasons& reasons) {
  std::string joined;
  for (const auto& reason : reasons) joined += (joined.empty() ? "" : "; ") + reason;
  std::string message;
  {
    std::lock_guard<std::mutex> guard(g_registry_mutex);
    message = state.refusal;
  }
  const auto at = message.find("{reasons}");
  if (at == std::string::npos) {
    message = "mla." + state.name + ": the native kernel cannot serve this call: " + joined;
  } else {
    message.replace(at, std::string_view("{reasons}").size(), joined);
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, message);
}

void record_native_op(std::string_view name, c10::KernelFunction reasons, bool may_refuse) {
  NativeOpRecord& record = record_of(name, /*create=*/true);
  std::lock_guard<std::mutex> guard(g_registry_mutex);
  record.reasons = std::move(reasons);
  record.may_refuse = may_refuse;
}

TORCH_LIBRARY(mla_native, m) {
  m.def("isas() -> str[]", &runnable_isas);
  m.def("isa() -> str", [] { return std::string(kIsaNames[static_cast<int>(kernel_isa())]); });
  m.def("set_isa(str isa) -> ()", [](std::string_view isa) { set_kernel_isa(parse_isa(isa)); });
  m.def("ops() -> str[]", [] { return registered_ops(/*only_those_that_may_refuse=*/false); });
  m.def("ops_with_reasons() -> str[]", [] { return registered_ops(/*only_those_that_may_refuse=*/true); });
  m.def("set_route(str op, str route, str refusal='') -> ()", &set_route);
  m.def("reasons(str op, Any[] args) -> str[]", torch::CppFunction::makeFromBoxedFunction<&reasons_boxed>());
  m.def("attention_engine(Tensor q_latent, Tensor key_cache, Tensor value_cache) -> str",
        [](const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache) {
          return isa_kernel<attention_engine_kernel>(kernel_isa())(q_latent, key_cache, value_cache);
        });
}

}  // namespace mla_native
