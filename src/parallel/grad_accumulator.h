#pragma once
#include <memory>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

// A parameter's gradient accumulator (the autograd node that adds into .grad, whose hooks DDP
// and ZeRO listen to), in the pointer libtorch holds it by: a shared_ptr in 1.13, an
// intrusive_ptr in 2.x.
namespace cohort::parallel::detail {

using GradAccumulator =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// The two below are templates whose branches depend on their parameter, so that only the
// installed libtorch's branch is compiled; call them without one.

// A new accumulator for `p`, with none of the hooks of `p`'s own.
template <class Pointer = GradAccumulator>
Pointer new_grad_accumulator(const at::Tensor& p) {
  using Accumulate =
      std::conditional_t<sizeof(Pointer) != 0, torch::autograd::AccumulateGrad, void>;
  if constexpr (std::is_same_v<Pointer, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<Accumulate>(p);
  else
    return c10::make_intrusive<Accumulate>(p);
}

// Makes `accumulator` the one that graphs recorded from now on accumulate `p`'s gradient with.
template <class Pointer = GradAccumulator>
void set_grad_accumulator(const at::Tensor& p, const Pointer& accumulator) {
  using Node = typename Pointer::element_type;
  if constexpr (std::is_same_v<Pointer, std::shared_ptr<torch::autograd::Node>>)
    torch::autograd::impl::set_grad_accumulator(p, std::weak_ptr<Node>(accumulator));
  else
    torch::autograd::impl::set_grad_accumulator(p, c10::weak_intrusive_ptr<Node>(accumulator));
}

}  // namespace cohort::parallel::detail
