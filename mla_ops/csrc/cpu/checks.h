// Argument checks of the native CPU kernels, in C++: the same conditions, in the same order and with
// the same messages as the Python checks of each op (mla_ops/_checks.py, mla_ops/ops/*.py), so a bad
// call reads the same whichever backend serves it (the case database's error inputs run against every
// backend). Messages are built only on failure, and format values the way Python prints them
// (`torch.bfloat16`, shapes as tuples `(2, 3)`, strings as 'repr', floats as repr(float)).
//
// A failed metadata check raises RuntimeError (TORCH_CHECK, like torch._check), a bad index value
// ValueError (TORCH_CHECK_VALUE), both before anything is written.
#pragma once

#include "isa.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

namespace mla_native {
inline namespace CPU_CAPABILITY {

// ------------------------------------------------------------------ values as Python prints them
inline std::string py_dtype(const at::Tensor& t) {
  return "torch." + std::string(c10::getDtypeNames(t.scalar_type()).first);
}

inline std::string py_tuple(c10::IntArrayRef values) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < values.size(); ++i) s << (i ? ", " : "") << values[i];
  s << (values.size() == 1 ? ",)" : ")");
  return s.str();
}

inline std::string py_shape(const at::Tensor& t) { return py_tuple(t.sizes()); }

// repr(str) for the plain strings the ops take (no escapes needed for what callers pass)
inline std::string py_repr(std::string_view value) {
  const char quote = (value.find('\'') != std::string_view::npos && value.find('"') == std::string_view::npos) ? '"'
                                                                                                               : '\'';
  std::string out(1, quote);
  for (char c : value) {
    if (c == '\\' || c == quote) out += '\\';
    out += c;
  }
  return out + quote;
}

inline std::string py_repr_tuple(std::initializer_list<std::string_view> values) {
  std::string out = "(";
  size_t i = 0;
  for (std::string_view v : values) out += (i++ ? ", " : "") + py_repr(v);
  return out + (values.size() == 1 ? ",)" : ")");
}

// repr(float): the shortest digits that round-trip, positional for exponents in [-4, 16), else
// d.ddde+XX; integral values keep a ".0".
inline std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // [-]d[.ddd]e(+|-)XX
  const size_t e = sci.find('e');
  const int exponent = std::stoi(sci.substr(e + 1));
  std::string sign, digits;
  for (size_t i = 0; i < e; ++i) {
    if (sci[i] == '-') sign = "-";
    else if (sci[i] != '.') digits += sci[i];
  }
  if (exponent < -4 || exponent >= 16) {
    std::string mantissa = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    std::string exp = std::to_string(std::abs(exponent));
    if (exp.size() < 2) exp = "0" + exp;
    return sign + mantissa + "e" + (exponent < 0 ? "-" : "+") + exp;
  }
  const int point = exponent + 1;  // digits before the decimal point
  std::string out;
  if (point <= 0) {
    out = "0." + std::string(-point, '0') + digits;
  } else if (point >= static_cast<int>(digits.size())) {
    out = digits + std::string(point - digits.size(), '0') + ".0";
  } else {
    out = digits.substr(0, point) + "." + digits.substr(point);
  }
  return sign + out;
}

// str(int) of a 128-bit product (Python ints do not overflow; messages must not either)
inline std::string py_int(__int128 v) {
  if (v == 0) return "0";
  const bool negative = v < 0;
  unsigned __int128 u = negative ? -static_cast<unsigned __int128>(v) : static_cast<unsigned __int128>(v);
  std::string digits;
  for (; u > 0; u /= 10) digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(u % 10)));
  return (negative ? "-" : "") + digits;
}

inline std::string prefix(std::string_view op) { return "mla." + std::string(op) + ": "; }

// ------------------------------------------------------------------------------ generic checks
inline void check_rank(std::string_view op, std::string_view name, const at::Tensor& t, int64_t rank,
                       std::string_view layout) {
  TORCH_CHECK(t.dim() == rank, prefix(op), name, " must be ", rank, "-D ", layout, ", got a ", t.dim(),
              "-D tensor of shape ", py_shape(t));
}

inline bool is_activation_dtype(at::ScalarType d) {
  return d == at::kFloat || d == at::kHalf || d == at::kBFloat16 || d == at::kDouble;
}

inline void check_float(std::string_view op, std::string_view name, const at::Tensor& t) {
  TORCH_CHECK(is_activation_dtype(t.scalar_type()), prefix(op), name,
              " must be float32, float16 or bfloat16 (float64 for gradcheck), got ", py_dtype(t));
}

inline void check_index(std::string_view op, std::string_view name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, prefix(op), name,
              " must be an int32 or int64 tensor, got ", py_dtype(t), "; convert it with .to(torch.int32)");
}

inline void check_same_dtype(std::string_view op, std::string_view name, const at::Tensor& t,
                             std::string_view ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), prefix(op), name, " has dtype ", py_dtype(t), " but ", ref_name,
              " has ", py_dtype(ref), "; they must match (cast with .to(", py_dtype(ref), "))");
}

template <typename A, typename B>
inline void check_size(std::string_view op, std::string_view name, A actual, B expected, std::string_view what) {
  TORCH_CHECK(actual == expected, prefix(op), name, " ", what, ": expected ", expected, ", got ", actual);
}

// (name, tensor or nullptr for an absent optional), in the order the Python check lists them
using NamedTensor = std::pair<std::string_view, const at::Tensor*>;

inline void check_same_device(std::string_view op, std::initializer_list<NamedTensor> tensors) {
  const at::Tensor* first = nullptr;
  bool same = true;
  for (const auto& [name, t] : tensors) {
    if (t == nullptr) continue;
    if (first == nullptr) first = t;
    else if (t->device() != first->device()) same = false;
  }
  if (same) return;
  std::string listed;
  for (const auto& [name, t] : tensors) {
    if (t == nullptr) continue;
    listed += (listed.empty() ? "" : ", ") + std::string(name) + " on " + t->device().str();
  }
  TORCH_CHECK(false, prefix(op), "all tensors must be on one device, got ", listed);
}

inline void check_writable_layout(std::string_view op, std::string_view name, const at::Tensor& t) {
  bool overlapping = false;
  for (int64_t d = 0; d < t.dim(); ++d) overlapping |= t.size(d) > 1 && t.stride(d) == 0;
  TORCH_CHECK(!overlapping, prefix(op), name, " has overlapping memory (a stride-0 dim, e.g. from expand: shape ",
              py_shape(t), ", strides ", py_tuple(t.strides()),
              ") and cannot be written; pass a tensor that owns its elements (.contiguous() or .clone())");
}

// mla_ops/ops/_paged.py: overlaps_memory. Whether a and b live in one storage with intersecting byte
// ranges from their first to their last element (interleaved strided views count as overlapping).
inline bool overlaps_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return false;
  const auto bytes = [](const at::Tensor& x) {  // [first, last + 1) bytes; strides are never negative
    int64_t last = x.storage_offset();
    for (int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
    const int64_t item = static_cast<int64_t>(x.itemsize());
    return std::pair<int64_t, int64_t>{x.storage_offset() * item, (last + 1) * item};
  };
  const auto [a_first, a_end] = bytes(a);
  const auto [b_first, b_end] = bytes(b);
  return a_first < b_end && b_first < a_end;
}

// mla_ops/_checks.py: check_softmax_scale (the bounds of a normal float32 number)
inline void check_softmax_scale(std::string_view op, double softmax_scale, std::string_view example = "") {
  constexpr double lowest = std::numeric_limits<float>::min(), highest = std::numeric_limits<float>::max();
  TORCH_CHECK(lowest <= softmax_scale && softmax_scale <= highest, prefix(op),
              "softmax_scale must be a positive normal float32 number", example, ", within [", py_float(lowest), ", ",
              py_float(highest), "] (the kernels scale in float32), got ", py_float(softmax_scale));
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
