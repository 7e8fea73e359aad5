// What the native ops that update Keras variables in place share (native_sum.cc's fused
// all-reduce and SGD step, cross_device/powersgd_ops.cc's PowerSGD step): Keras' SGD
// arithmetic, the variables' locks, and when a variable's buffer may be written over.
#ifndef TF_DISTRIB_TRANSPORT_NATIVE_UPDATE_H_
#define TF_DISTRIB_TRANSPORT_NATIVE_UPDATE_H_

#include <algorithm>
#include <memory>
#include <vector>

#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_distrib {

// Keras' SGD step on the gradients' sum g, each operation rounded as TensorFlow's kernels
// round Keras' ops (the build turns contracting them into fused multiply-adds off): the
// new weight `w - g * rate`. V: a float, or a vector of floats (the scalars broadcast).
template <typename V, typename S>
inline V SgdWeight(V w, V g, S rate) {
  return w - g * rate;
}

// With momentum: the new velocity `v' = v * momentum - g * rate` into *velocity, and the
// new weight `w + v'`, or Nesterov's `w + (v' * momentum - g * rate)`.
template <typename V, typename S>
inline V MomentumWeight(V w, V v, V g, S rate, S momentum, bool nesterov, V* velocity) {
  const V step = g * rate, next = v * momentum - step;
  *velocity = next;
  return w + (nesterov ? next * momentum - step : next);
}

// Holds variables' mutexes, each once, taken in address order as TensorFlow's kernels take
// several (no deadlock with an op that locks some of them): no reader sees an update half
// written, and the variables' values keep the holders they had when the update chose
// where to write.
class Locked {
 public:
  explicit Locked(const std::vector<::tensorflow::core::RefCountPtr<::tensorflow::Var>>& v) {
    std::vector<::tensorflow::mutex*> mutexes;
    for (const auto& variable : v) mutexes.push_back(variable->mu());
    std::sort(mutexes.begin(), mutexes.end());
    mutexes.erase(std::unique(mutexes.begin(), mutexes.end()), mutexes.end());
    for (::tensorflow::mutex* mu : mutexes) {
      locks_.push_back(std::make_unique<::tensorflow::mutex_lock>(*mu));
    }
  }

 private:
  std::vector<std::unique_ptr<::tensorflow::mutex_lock>> locks_;
};

// Whether `value`, a copy of a variable's value taken under its lock, shares its buffer
// with the variable alone: then nothing else reads it, and it may be written over.
inline bool OnlyTheVariableHolds(const ::tensorflow::Tensor& value) {
  return value.RefCount() == 2;
}

}  // namespace tf_distrib

#endif  // TF_DISTRIB_TRANSPORT_NATIVE_UPDATE_H_
