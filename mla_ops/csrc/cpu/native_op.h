// How an op reaches its native kernel from the dispatcher (registration.cpp registers each op with
// `register_native_op`): one CPU kernel and one AutogradCPU kernel per op, registered statically.
//
// CPU: the route the backend layer set for the op (mla_ops/backends: the process's backend setting,
// `MLA_OPS_BACKEND` / `mla_ops.set_backend`, read here on every call; nothing is re-registered when it
// changes) decides:
// * native (cpu_native is the automatic choice) or demanded (cpu_native requested by name): the op's
//   metadata check, then the backend's reasons (reasons.h); none: the kernel of the chosen ISA (isa.h).
//   Reasons: the call goes to the reference kernel, or — demanded — is refused with NotImplementedError
//   naming them.
// * elsewhere (another backend is the CPU choice, or the extension is loaded but not routed yet): the
//   call goes on to the op's CompositeExplicitAutograd kernel, where the backend layer serves it.
// AutogradCPU (autograd.cpp): with no input requiring a gradient, straight to the CPU kernel.
#pragma once

#include "isa.h"
#include "reasons.h"

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

namespace mla_native {

enum class Route : int { kElsewhere = 0, kNative = 1, kDemanded = 2 };

// One op's routing state (native_op.cpp keeps one per registered op, by name).
struct NativeOpState {
  std::string name;
  std::atomic<int> route{static_cast<int>(Route::kElsewhere)};
  std::string refusal;  // NotImplementedError text of a demand, "{reasons}" standing for the reasons
  const c10::OperatorHandle& op() const;  // mla::<name>, looked up on first use

 private:
  mutable std::optional<c10::OperatorHandle> handle_;
};

NativeOpState& native_op_state(std::string_view name);
[[noreturn]] void refuse(const NativeOpState& state, const Reasons& reasons);

// For torch.ops.mla_native.reasons (explain): the op's reasons as a boxed kernel, and whether it has any.
void record_native_op(std::string_view name, c10::KernelFunction reasons, bool may_refuse);

// AutogradCPU kernel of every native op (autograd.cpp).
void autograd_cpu(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

template <typename T>
c10::IValue to_ivalue(const T& value) {
  if constexpr (std::is_same_v<T, std::string_view>) {
    return c10::IValue(std::string(value));
  } else {
    return c10::IValue(value);
  }
}

// The op's CompositeExplicitAutograd kernel (the backend layer's: the reference, or the backend the
// setting chose), with these arguments.
template <typename R, typename... Args>
R call_composite(const NativeOpState& state, const Args&... args) {
  torch::jit::Stack stack;
  stack.reserve(sizeof...(Args));
  (stack.push_back(to_ivalue(args)), ...);
  state.op().callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, stack);
  if constexpr (!std::is_void_v<R>) return c10::impl::PopResult<R>::call(stack);
}

template <typename Signature>
struct NativeOp;

template <typename R, typename... Args>
struct NativeOp<R(Args...)> {
  // The CPU kernel of the op of `Kernel` (see the top of this file).
  template <typename Kernel, auto check, typename ReasonsFn>
  static R serve(Args... args) {
    static NativeOpState& state = native_op_state(Kernel::kName);
    const auto route = static_cast<Route>(state.route.load(std::memory_order_relaxed));
    if (route != Route::kElsewhere) {
      check(args...);
      const Reasons reasons = ReasonsFn{}(args...);
      if (reasons.empty()) return isa_kernel<Kernel>(kernel_isa())(args...);
      if (route == Route::kDemanded) refuse(state, reasons);
    }
    return call_composite<R>(state, args...);
  }

  template <typename ReasonsFn>
  static Reasons reasons(Args... args) {
    return ReasonsFn{}(args...);
  }
};

// Registers op `Kernel::kName` (in a TORCH_LIBRARY_IMPL(mla, CatchAll, m) block): its CPU kernel (its
// metadata check `check`, the backend's reasons `ReasonsFn`, the kernel `Kernel` of the chosen ISA) and
// its AutogradCPU kernel.
template <typename Kernel, auto check, typename ReasonsFn>
void register_native_op(torch::Library& m) {
  using Op = NativeOp<typename Kernel::Fn>;
  m.impl(Kernel::kName,
         torch::dispatch(c10::DispatchKey::CPU,
                         c10::CompileTimeFunctionPointer<typename Kernel::Fn,
                                                         &Op::template serve<Kernel, check, ReasonsFn>>()));
  m.impl(Kernel::kName, torch::dispatch(c10::DispatchKey::AutogradCPU,
                                        torch::CppFunction::makeFromBoxedFunction<&autograd_cpu>()));
  using ReasonsSignature = std::remove_pointer_t<decltype(&Op::template reasons<ReasonsFn>)>;
  record_native_op(Kernel::kName,
                   c10::KernelFunction::makeFromUnboxedFunction(
                       c10::CompileTimeFunctionPointer<ReasonsSignature, &Op::template reasons<ReasonsFn>>()),
                   !std::is_same_v<ReasonsFn, ServesEveryCall>);
}

}  // namespace mla_native
