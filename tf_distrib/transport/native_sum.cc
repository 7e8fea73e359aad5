// TfDistribSharedSum: the same-host reduce-scatter of shared_memory.py as a TensorFlow op.
//
// It follows the Python reducer's protocol on the same segment and counters, step for
// step as its path that sums into the slots (`all_reduce_scattered` when the result
// regions are held): per slot-sized chunk, each worker copies the parts the others sum
// into its slot, raises its written counter, sums its own part in rank order into its
// outputs and its slot, raises its summed counter, and copies the others' sums out of
// their slots. The sums land in tensors TensorFlow allocated (or the inputs, forwarded),
// which the optimizer may then overwrite in place; numpy_function's results are views
// TensorFlow may not overwrite, and that costs the optimizer a new buffer per step.
//
// What a worker writes into its slot only the others read, so it goes there with
// non-temporal stores (x86-64), past this core's cache, which keeps its own data and need
// not hand each line over to the reader's core (the likely reason; not profiled). Measured
// on the MLP of `bench scaling`, 2 workers x 1 core, the two stores alternating by epoch
// within one run: 0.04-0.39 ms less CPU per step in 9 of 10 worker-runs (medians of 15-19
// pairs; the tenth +0.40 ms).
//
// TfDistribSharedSgd and TfDistribSharedMomentum run the same collective and take Keras'
// `SGD` step on the way (without momentum; with it, plain or Nesterov): each worker turns
// its own part's sum into the new weights (and velocities), rounded as Keras' multiplies,
// adds and subtracts round, and assigns the variables itself. Each worker updates only
// its part: the update's arithmetic and memory traffic are split between the workers, and
// the sums are never written out whole. Where it can, each writes its part into one of
// the segment's two update regions, and every worker's variables then hold that region:
// one copy of the weights in the host's memory and cache for all of them, nobody copies
// the others' parts, and from the next step on the update is made in place, as
// TensorFlow updates a variable whose buffer nothing else holds. Each process counts its
// tensors in each region; a region is usable when none is there, or when only the
// update's variables are, each at its place (with the variables locked, as TensorFlow's
// `use_locking` kernels lock them, so no reader sees an update half made). Each worker
// publishes its usable regions with the first chunk, and all write into the first one
// usable on every worker; where none is (a value read from a variable and kept), or the
// values do not fit, the new values go to this worker's slot (the velocities to the
// slot's second half: a chunk is then half a slot) and to private buffers, and each worker
// copies the others' parts out of their slots. The region's tensors do not own their
// memory, so TensorFlow never writes into them: an `assign_sub` or a kernel that would
// reuse its input's buffer copies first, and only this op writes a region.
//
// The waits poll like the Python ones (spin, yield, sleep) and return an error once the
// control block's abort word is set: the transport's watcher thread sets it when a peer
// is lost, naming it in the block's message (native_control.h).
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "native_control.h"
#include "native_update.h"

namespace tf_distrib {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

// The control block's words after the recorder (native_control.h has the others): this
// process's tensors in each of the two update regions, the updates that went through a
// region, and those of them that found their variables there.
constexpr int kRegions = 2;
constexpr int kHeld = kControlWords, kRegionUpdates = kHeld + kRegions,
              kInPlaceUpdates = kRegionUpdates + 1;
// Elements summed, then copied out, at a time (16-32 KiB: the core's L1 cache).
constexpr int64_t kBlock = 4096;
// Polling, as shared_memory.py's `_poll`.
constexpr int64_t kSpinNs = 20000, kYieldNs = 2000000, kSleepNs = 100000;

// The block a worker sums into overlaps none of the addends: both loops vectorize.
template <typename T>
void Add(T* __restrict sum, const T* __restrict a, const T* __restrict b, int64_t n) {
  for (int64_t j = 0; j < n; ++j) sum[j] = a[j] + b[j];
}
template <typename T>
void AddTo(T* __restrict sum, const T* __restrict b, int64_t n) {
  for (int64_t j = 0; j < n; ++j) sum[j] += b[j];
}
// Keras' SGD steps on the sum `g` (native_update.h), overwriting it with the new weights.
template <typename T>
void Descend(T* __restrict g, const T* __restrict w, T rate, int64_t n) {
  for (int64_t j = 0; j < n; ++j) g[j] = SgdWeight(w[j], g[j], rate);
}
template <typename T>
void Accelerate(T* __restrict g, T* __restrict velocity, const T* __restrict w,
                const T* __restrict m, T rate, T momentum, bool nesterov, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    g[j] = MomentumWeight(w[j], m[j], g[j], rate, momentum, nesterov, &velocity[j]);
  }
}

// Copies `bytes` into shared memory that other cores read, with non-temporal stores
// where the CPU has them; Fence() then orders them before the counter that publishes
// them (a release store orders only ordinary stores).
void CopyToShared(void* dst, const void* src, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  const int64_t misaligned = reinterpret_cast<uintptr_t>(d) % 16;
  const int64_t head = std::min(bytes, misaligned ? 16 - misaligned : int64_t{0});
  std::memcpy(d, s, head);
  int64_t i = head;
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(d, s, bytes);
#endif
}

void Fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// What a collective's word on the counters' line says it runs: up to 8 ASCII bytes (the
// dtype's name for a sum, see shared_memory.dtype_code; native_sum.py's codes otherwise).
std::string Kind(int64_t word) {
  char name[sizeof(word)];
  std::memcpy(name, &word, sizeof(word));
  return std::string(name, strnlen(name, sizeof(word)));
}

// What the op does with each sum: return it (TfDistribSharedSum: ticket, tensors), or
// take Keras' SGD step (TfDistribSharedSgd: ticket, learning rate, gradients, weights'
// variables; TfDistribSharedMomentum: ticket, learning rate, momentum, gradients,
// weights' variables, velocities' variables).
enum Update { kSum, kSgd, kMomentum };

// The inputs before the gradients, the inputs per gradient (the gradient, then an
// update's variables), and the values computed per gradient (the sum, or the variables'
// new values; each travels through the slots), for the kernel and the registration alike.
template <Update kUpdate>
struct Signature {
  static constexpr int kFirst = kUpdate == kSum ? 1 : kUpdate == kSgd ? 2 : 3;
  static constexpr int kInputs = kUpdate == kSum ? 1 : kUpdate == kSgd ? 2 : 3;
  static constexpr int kOutputs = kUpdate == kMomentum ? 2 : 1;
};

// A region's part for one variable, which every worker's variable may hold. It does not
// own its memory, so no TensorFlow kernel writes into it; it counts itself among the
// region's holders in this process while it lives.
class RegionBuffer : public ::tensorflow::TensorBuffer {
 public:
  RegionBuffer(void* data, size_t bytes, int64_t* holders)
      : TensorBuffer(data), bytes_(bytes), holders_(holders) {
    __atomic_add_fetch(holders_, 1, __ATOMIC_ACQ_REL);
  }
  ~RegionBuffer() override { __atomic_sub_fetch(holders_, 1, __ATOMIC_ACQ_REL); }
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(::tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(bytes_);
    proto->set_allocator_name("tf_distrib_update_region");
  }
  bool OwnsMemory() const override { return false; }

 private:
  size_t bytes_;
  int64_t* holders_;
};

template <typename T, Update kUpdate>
class SharedSum : public OpKernel {
  // Tensors and parts start on 64-byte lines, as in shared_memory.py and buffers.py.
  static constexpr int64_t kStep = 64 / sizeof(T);
  static constexpr int kFirst = Signature<kUpdate>::kFirst;
  static constexpr int kInputs = Signature<kUpdate>::kInputs;
  static constexpr int kOutputs = Signature<kUpdate>::kOutputs;

  // One call's tensors: the addends, an update's current values, the outputs (k * n + i:
  // value k of tensor i), each tensor's place in the flat layout; whether the outputs are
  // an update region, and whether they were the variables' values already.
  struct Arrays {
    std::vector<const T*> in, weights, velocities;
    std::vector<T*> out;
    std::vector<int64_t> start, size;
    T rate = 0, momentum = 0;
    bool in_region = false, in_place = false;
  };

  // One slot-sized chunk of a collective: its first element, number, and each rank's part.
  struct Round {
    int64_t first, chunk;
    std::vector<int64_t> bounds;
    std::vector<T*> slots;
  };

 public:
  explicit SharedSum(OpKernelConstruction* c) : OpKernel(c) {
    int64_t segment, control;
    OP_REQUIRES_OK(c, c->GetAttr("segment", &segment));
    OP_REQUIRES_OK(c, c->GetAttr("control", &control));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(c, c->GetAttr("world", &world_));
    OP_REQUIRES_OK(c, c->GetAttr("chunk_bytes", &chunk_bytes_));
    OP_REQUIRES_OK(c, c->GetAttr("header_bytes", &header_bytes_));
    OP_REQUIRES_OK(c, c->GetAttr("lines", &lines_));
    OP_REQUIRES_OK(c, c->GetAttr("line_bytes", &line_bytes_));
    OP_REQUIRES_OK(c, c->GetAttr("written", &written_));
    OP_REQUIRES_OK(c, c->GetAttr("summed", &summed_));
    OP_REQUIRES_OK(c, c->GetAttr("dtype_code", &dtype_code_));
    OP_REQUIRES_OK(c, c->GetAttr("offered", &offered_));
    OP_REQUIRES_OK(c, c->GetAttr("update_regions", &update_regions_));
    OP_REQUIRES_OK(c, c->GetAttr("region_bytes", &region_bytes_));
    if (kUpdate == kMomentum) OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov_));
    segment_ = reinterpret_cast<char*>(segment);
    control_ = reinterpret_cast<int64_t*>(control);
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, Aborted(control_));
    const int n = (ctx->num_inputs() - kFirst) / kInputs;
    Arrays a;
    a.in.resize(n);
    a.out.resize(kOutputs * n);
    a.start.resize(n);
    a.size.resize(n);
    if (kUpdate != kSum) a.rate = ctx->input(1).scalar<T>()();
    if (kUpdate == kMomentum) a.momentum = ctx->input(2).scalar<T>()();
    // An update's variables (variable k * n + i: the weights' of tensor i, then the
    // velocities'), held locked until they are assigned, and their values now.
    std::vector<::tensorflow::core::RefCountPtr<::tensorflow::Var>> variables(
        (kInputs - 1) * n);
    for (size_t j = 0; j < variables.size(); ++j) {
      OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(
                              ctx, ::tensorflow::HandleFromInput(ctx, kFirst + n + j),
                              &variables[j]));
    }
    const Locked locked(variables);
    std::vector<Tensor> values(variables.size());
    bool copy_on_read = false;
    int64_t total = 0;  // the flat layout's elements, each tensor on a 64-byte line
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(kFirst + i);
      for (int k = 1; k < kInputs; ++k) {
        const int j = (k - 1) * n + i;
        OP_REQUIRES(ctx, variables[j]->is_initialized,
                    ::tensorflow::errors::FailedPrecondition(
                        "the variable of gradient ", i, " is not initialized"));
        values[j] = *variables[j]->tensor();
        copy_on_read |= variables[j]->copy_on_read_mode.load();
        OP_REQUIRES(ctx, values[j].dtype() == t.dtype() && values[j].shape() == t.shape(),
                    ::tensorflow::errors::InvalidArgument(
                        "gradient ", i, " has shape ", t.shape().DebugString(), ", its ",
                        k == 1 ? "weights " : "velocities ", values[j].DebugString()));
        (k == 1 ? a.weights : a.velocities).push_back(values[j].flat<T>().data());
      }
      if (kUpdate == kSum) {
        Tensor* o = nullptr;  // the sum may take the gradient's buffer
        OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({kFirst + i}, i, t.shape(),
                                                                  &o));
        a.out[i] = o->flat<T>().data();
      }
      a.in[i] = t.flat<T>().data();
      a.size[i] = t.NumElements();
      a.start[i] = total;
      total += (a.size[i] + kStep - 1) / kStep * kStep;
    }
    Recorded recorded(control_, ctx->input(0).scalar<int64_t>()(), total * int64_t{sizeof(T)});
    // The update regions this worker can write (bit r: region r).
    const int64_t usable = kUpdate == kSum ? 0 : Usable(total, a, values, copy_on_read);
    std::vector<Tensor> updated(kUpdate == kSum ? 0 : kOutputs * n);
    // Each output has its region of the slot, on a 64-byte line.
    const int64_t per_chunk = chunk_bytes_ / sizeof(T) / kOutputs / kStep * kStep;
    for (int64_t first = 0; first < total; first += per_chunk) {
      Round round;
      OP_REQUIRES_OK(ctx, Publish(first, std::min(total, first + per_chunk), total, a,
                                  kUpdate != kSum && first == 0 ? usable : -1, round));
      if (kUpdate != kSum && first == 0) {
        OP_REQUIRES_OK(ctx, Outputs(ctx, n, total, Agreed(usable), a, values, updated));
      }
      OP_REQUIRES_OK(ctx, Reduce(round, per_chunk, a));
    }
    for (size_t j = 0; j < updated.size(); ++j) *variables[j]->tensor() = std::move(updated[j]);
    if (a.in_region) __atomic_add_fetch(control_ + kRegionUpdates, 1, __ATOMIC_RELAXED);
    if (a.in_place) __atomic_add_fetch(control_ + kInPlaceUpdates, 1, __ATOMIC_RELAXED);
    recorded.Done();
  }

 private:
  int64_t* Line(int rank) const {
    return reinterpret_cast<int64_t*>(segment_ + lines_ + rank * line_bytes_);
  }
  T* Slot(int64_t generation, int rank) const {
    return reinterpret_cast<T*>(segment_ + header_bytes_ +
                                    (generation * world_ + rank) * chunk_bytes_);
  }

  // Calls f(tensor, flat position, elements) for the tensors' elements in [lo, hi).
  template <typename F>
  static void Pieces(const std::vector<int64_t>& start, const std::vector<int64_t>& size,
                     int64_t lo, int64_t hi, F f) {
    for (size_t i = 0; i < start.size(); ++i) {
      const int64_t a = std::max(lo, start[i]), b = std::min(hi, start[i] + size[i]);
      if (a < b) f(i, a, b - a);
    }
  }

  // Region r's address.
  T* Region(int64_t r) const {
    return reinterpret_cast<T*>(segment_ + update_regions_ + r * region_bytes_);
  }

  // The update regions (bit r: region r) this worker can write an update's new values into:
  // those that no tensor of this process refers to, and the one that only the update's
  // variables refer to, each at its own place (the values, as TensorFlow updates a
  // variable in place only when nothing else holds its buffer). None where the values do
  // not fit or a variable copies on read.
  int64_t Usable(int64_t total, const Arrays& a, const std::vector<Tensor>& values,
                 bool copy_on_read) const {
    if (copy_on_read || kOutputs * total * int64_t{sizeof(T)} > region_bytes_) return 0;
    const int n = static_cast<int>(a.in.size());
    int64_t usable = 0;
    for (int64_t r = 0; r < kRegions; ++r) {
      const int64_t held = Load(control_ + kHeld + r);
      usable |= int64_t{held == 0 || (held == kOutputs * n &&
                                      InPlace(r, total, a, values))} << r;
    }
    return usable;
  }

  // Whether each variable's value is region r's at its place, held by the variable and
  // by `values` only.
  bool InPlace(int64_t r, int64_t total, const Arrays& a,
               const std::vector<Tensor>& values) const {
    const int n = static_cast<int>(a.in.size());
    for (int k = 0; k < kOutputs; ++k) {
      for (int i = 0; i < n; ++i) {
        const Tensor& value = values[k * n + i];
        if (value.data() != Region(r) + k * total + a.start[i] || !OnlyTheVariableHolds(value)) {
          return false;
        }
      }
    }
    return true;
  }

  // The update region that every worker can write (the first), or -1 (after the first
  // chunk's `Publish`: each published its usable regions with it).
  int64_t Agreed(int64_t usable) const {
    for (int r = 0; r < world_; ++r) usable &= Line(r)[offered_];
    for (int64_t r = 0; r < kRegions; ++r) {
      if (usable >> r & 1) return r;
    }
    return -1;
  }

  // An update's new values: in update region `region`, or with -1 in private buffers (the
  // new weights in the gradient's, where TensorFlow can forward it).
  ::tensorflow::Status Outputs(OpKernelContext* ctx, int n, int64_t total, int64_t region,
                               Arrays& a, const std::vector<Tensor>& values,
                               std::vector<Tensor>& updated) {
    a.in_region = region >= 0;
    // A usable region that this process holds tensors in holds only the variables, each at
    // its place (`Usable`); the locks keep it so.
    a.in_place = a.in_region && Load(control_ + kHeld + region) != 0;
    for (int k = 0; k < kOutputs; ++k) {
      for (int i = 0; i < n; ++i) {
        const Tensor& t = ctx->input(kFirst + i);
        Tensor& out = updated[k * n + i];
        if (a.in_place) {
          out = values[k * n + i];
        } else if (a.in_region) {
          auto* buffer = new RegionBuffer(Region(region) + k * total + a.start[i],
                                          a.size[i] * sizeof(T), control_ + kHeld + region);
          out = Tensor(::tensorflow::DataTypeToEnum<T>::value, t.shape(), buffer);
          buffer->Unref();
        } else {
          std::unique_ptr<Tensor> forwarded =
              k == 0 ? ctx->forward_input(kFirst + i,
                                          OpKernelContext::Params::kNoReservation,
                                          t.dtype(), t.shape(), ::tensorflow::DEVICE_MEMORY,
                                          ::tensorflow::AllocatorAttributes())
                     : nullptr;
          if (forwarded) {
            out = std::move(*forwarded);
          } else {
            TF_RETURN_IF_ERROR(ctx->allocate_temp(t.dtype(), t.shape(), &out));
          }
        }
        a.out[k * n + i] = out.flat<T>().data();
      }
    }
    return ::tensorflow::OkStatus();
  }

  // Copies the parts of [first, stop) that the others sum into this worker's slot,
  // publishes it (with the update regions it can write, unless -1), and waits until every
  // worker has.
  ::tensorflow::Status Publish(int64_t first, int64_t stop, int64_t total, const Arrays& a,
                               int64_t usable, Round& round) {
    const int64_t elements = stop - first;
    round.first = first;
    round.bounds.resize(world_ + 1);
    for (int r = 0; r <= world_; ++r) {
      const int64_t even = (elements * r + world_ - 1) / world_;
      round.bounds[r] = std::min(elements, (even + kStep - 1) / kStep * kStep);
    }
    int64_t* mine = Line(rank_);
    round.chunk = Load(mine + written_) + 1;
    const int64_t generation = (round.chunk - 1) % 2;
    round.slots.resize(world_);
    for (int r = 0; r < world_; ++r) round.slots[r] = Slot(generation, r);
    const int64_t low = first + round.bounds[rank_], high = first + round.bounds[rank_ + 1];
    // The parts the others sum, into this worker's slot (padding stays unread).
    auto to_slot = [&](size_t i, int64_t at, int64_t count) {
      CopyToShared(round.slots[rank_] + (at - first), a.in[i] + (at - a.start[i]),
                   count * sizeof(T));
    };
    Pieces(a.start, a.size, first, low, to_slot);
    Pieces(a.start, a.size, high, stop, to_slot);
    mine[1 + 2 * generation] = total * int64_t{sizeof(T)};
    mine[2 + 2 * generation] = dtype_code_;
    if (usable >= 0) mine[offered_] = usable;
    Fence();
    Store(mine + written_, round.chunk);
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      TF_RETURN_IF_ERROR(Wait(r, written_, round.chunk));
      const int64_t* theirs = Line(r);
      if (theirs[1 + 2 * generation] != mine[1 + 2 * generation] ||
          theirs[2 + 2 * generation] != dtype_code_) {
        return ::tensorflow::errors::Internal(
            "ProtocolError: worker ", r, " runs a different collective (",
            theirs[1 + 2 * generation], " bytes of ", Kind(theirs[2 + 2 * generation]),
            ") than this one (", total * sizeof(T), " bytes of ", Kind(dtype_code_),
            "): the workers do not run the same model or step.");
      }
    }
    return ::tensorflow::OkStatus();
  }

  // Sums this worker's part of a published chunk into its outputs (an update region,
  // which every worker reads, or its outputs and its slot), waits until every worker has
  // summed its part, and copies the others' parts out of their slots unless in a region.
  // `region`: the elements between the starts of an output's regions in a slot.
  ::tensorflow::Status Reduce(const Round& round, int64_t region, const Arrays& a) {
    const std::vector<int64_t>& start = a.start;
    const std::vector<T*>& slots = round.slots;
    const int n_tensors = static_cast<int>(a.in.size());
    const int64_t first = round.first;
    const int64_t low = first + round.bounds[rank_], high = first + round.bounds[rank_ + 1];
    // This worker's part, summed in rank order (as numpy does: bitwise the same sums) a
    // block at a time into a buffer that stays in cache (an output may be its own input,
    // forwarded), updated there with SGD, then copied to its outputs (and its slot).
    const int64_t block_size = std::min(kBlock, high - low);
    std::vector<T> block(kOutputs * block_size);
    Pieces(start, a.size, low, high, [&](size_t i, int64_t at, int64_t count) {
      for (int64_t done = 0; done < count; done += kBlock) {
        const int64_t n = std::min(kBlock, count - done), offset = at - first + done;
        const int64_t own_at = (at - start[i]) + done;
        const T* own = a.in[i] + own_at;
        T* sum = block.data();
        Add(sum, rank_ == 0 ? own : slots[0] + offset, rank_ == 1 ? own : slots[1] + offset, n);
        for (int r = 2; r < world_; ++r) AddTo(sum, r == rank_ ? own : slots[r] + offset, n);
        if (kUpdate == kSgd) Descend(sum, a.weights[i] + own_at, a.rate, n);
        if (kUpdate == kMomentum) {
          Accelerate(sum, sum + block_size, a.weights[i] + own_at, a.velocities[i] + own_at,
                     a.rate, a.momentum, nesterov_, n);
        }
        for (int k = 0; k < kOutputs; ++k) {
          std::memcpy(a.out[k * n_tensors + i] + own_at, sum + k * block_size, n * sizeof(T));
          if (!a.in_region) {
            CopyToShared(slots[rank_] + k * region + offset, sum + k * block_size,
                         n * sizeof(T));
          }
        }
      }
    });
    Fence();
    int64_t* mine = Line(rank_);
    Store(mine + summed_, round.chunk);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) TF_RETURN_IF_ERROR(Wait(r, summed_, round.chunk));
    }
    for (int r = 0; r < world_ && !a.in_region; ++r) {
      if (r == rank_) continue;
      Pieces(start, a.size, first + round.bounds[r], first + round.bounds[r + 1],
             [&](size_t i, int64_t at, int64_t count) {
               for (int k = 0; k < kOutputs; ++k) {
                 std::memcpy(a.out[k * n_tensors + i] + (at - start[i]),
                             slots[r] + k * region + (at - first), count * sizeof(T));
               }
             });
    }
    return ::tensorflow::OkStatus();
  }

  // Returns once worker `peer`'s counter `field` reaches `chunk`, or the abort's error.
  ::tensorflow::Status Wait(int peer, int64_t field, int64_t chunk) {
    const int64_t* counter = Line(peer) + field;
    if (Load(counter) >= chunk) return ::tensorflow::OkStatus();
    Store(control_ + kWaitingFor, peer + 1);
    const int64_t began = Now();
    while (Load(counter) < chunk) {
      if (Load(control_ + kAbort)) {
        Store(control_ + kWaitingFor, 0);
        return Aborted(control_);
      }
      const int64_t waited = Now() - began;
      if (waited > kYieldNs) {
        timespec pause{0, kSleepNs};
        nanosleep(&pause, nullptr);
      } else if (waited > kSpinNs) {
        sched_yield();
      }
    }
    Store(control_ + kWaitingFor, 0);
    __atomic_add_fetch(control_ + kWaitedNanoseconds, Now() - began, __ATOMIC_RELAXED);
    return ::tensorflow::OkStatus();
  }

  char* segment_;
  int64_t* control_;
  int rank_, world_;
  int64_t chunk_bytes_, header_bytes_, lines_, line_bytes_, written_, summed_, dtype_code_;
  int64_t offered_, update_regions_, region_bytes_;
  bool nesterov_ = false;
};

}  // namespace

// What every collective takes besides its tensors: their count, and what binds the op to
// one transport's segment and control block (native_sum.py's `NativeSum._attrs`). The
// updates assign their variables and have no outputs.
#define COLLECTIVE_ATTRS                                                                 \
  .Attr("N: int >= 1")                                                                   \
      .Attr("segment: int").Attr("control: int").Attr("rank: int").Attr("world: int >= 2") \
      .Attr("chunk_bytes: int").Attr("header_bytes: int").Attr("lines: int")             \
      .Attr("line_bytes: int").Attr("written: int").Attr("summed: int")                  \
      .Attr("dtype_code: int").Attr("offered: int").Attr("update_regions: int")          \
      .Attr("region_bytes: int")                                                         \
      .SetIsStateful()

REGISTER_OP("TfDistribSharedSum")
    .Input("ticket: int64")
    .Input("tensors: N * T")
    .Output("sums: N * T")
    .Attr("T: {float, int64}")
    COLLECTIVE_ATTRS
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 1; i < c->num_inputs(); ++i) c->set_output(i - 1, c->input(i));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribSharedSgd")
    .Input("ticket: int64")
    .Input("learning_rate: T")
    .Input("gradients: N * T")
    .Input("weights: N * resource")
    .Attr("T: {float}")
    COLLECTIVE_ATTRS
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);

REGISTER_OP("TfDistribSharedMomentum")
    .Input("ticket: int64")
    .Input("learning_rate: T")
    .Input("momentum: T")
    .Input("gradients: N * T")
    .Input("weights: N * resource")
    .Input("velocities: N * resource")
    .Attr("T: {float}")
    .Attr("nesterov: bool")
    COLLECTIVE_ATTRS
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs);

REGISTER_KERNEL_BUILDER(
    Name("TfDistribSharedSum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    (SharedSum<float, kSum>));
// int64: TensorFlow's per-step count of the workers whose input still has data.
REGISTER_KERNEL_BUILDER(
    Name("TfDistribSharedSum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("T"),
    (SharedSum<int64_t, kSum>));
REGISTER_KERNEL_BUILDER(
    Name("TfDistribSharedSgd").Device(::tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    (SharedSum<float, kSgd>));
REGISTER_KERNEL_BUILDER(
    Name("TfDistribSharedMomentum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    (SharedSum<float, kMomentum>));

}  // namespace tf_distrib
