// A custom operator written in C++ for tests/test_custom_ops_cpp.py: built at test time
// with torch.utils.cpp_extension and loaded as PopTorch users loaded their custom op
// libraries (ctypes.cdll.LoadLibrary). Its attributes cover every type custom_op
// accepts: float, int, string and lists of each.
//
//   out  = alpha * sum(scales) * x^power + sign(mode) * bias + sum(offsets)
//   echo = x * len(tags)
//
// The backward kernel is a second operator; the autograd formula that connects the
// two is registered from Python with torch.library.register_autograd.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace {

double sign_of(c10::string_view mode) {
  if (mode == "add") return 1.0;
  if (mode == "subtract") return -1.0;
  TORCH_CHECK(false, "ScaledCube: mode must be 'add' or 'subtract', got '",
              std::string(mode), "'");
}

double sum_of(c10::ArrayRef<double> values) {
  double total = 0.0;
  for (double v : values) total += v;
  return total;
}

int64_t sum_of_ints(c10::ArrayRef<int64_t> values) {
  int64_t total = 0;
  for (int64_t v : values) total += v;
  return total;
}

std::tuple<at::Tensor, at::Tensor> scaled_cube(
    const at::Tensor& x, const at::Tensor& bias, double alpha, int64_t power,
    c10::string_view mode, c10::ArrayRef<double> scales, c10::ArrayRef<int64_t> offsets,
    const std::vector<std::string>& tags) {
  TORCH_CHECK(x.sizes() == bias.sizes(), "ScaledCube: x and bias must have one shape");
  const double scale = alpha * sum_of(scales);
  at::Tensor out = x.pow(power).mul(scale).add(bias, sign_of(mode))
                       .add(static_cast<double>(sum_of_ints(offsets)));
  at::Tensor echo = x.mul(static_cast<double>(tags.size()));
  return std::make_tuple(out, echo);
}

std::tuple<at::Tensor, at::Tensor> scaled_cube_backward(
    const at::Tensor& grad_out, const at::Tensor& grad_echo, const at::Tensor& x,
    double alpha, int64_t power, c10::string_view mode, c10::ArrayRef<double> scales,
    const std::vector<std::string>& tags) {
  const double scale = alpha * sum_of(scales) * static_cast<double>(power);
  at::Tensor grad_x = grad_out.mul(x.pow(power - 1)).mul(scale)
                          .add(grad_echo, static_cast<double>(tags.size()));
  at::Tensor grad_bias = grad_out.mul(sign_of(mode));
  return std::make_tuple(grad_x, grad_bias);
}

}  // namespace

TORCH_LIBRARY(com_acme, m) {
  m.def("ScaledCube(Tensor x, Tensor bias, *, float alpha, int power, str mode, "
        "float[] scales, int[] offsets, str[] tags) -> (Tensor, Tensor)");
  m.def("ScaledCubeBackward(Tensor grad_out, Tensor grad_echo, Tensor x, *, "
        "float alpha, int power, str mode, float[] scales, str[] tags) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(com_acme, CPU, m) {
  m.impl("ScaledCube", &scaled_cube);
  m.impl("ScaledCubeBackward", &scaled_cube_backward);
}
