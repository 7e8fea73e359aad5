// TfDistribExchangeSum: the TCP transport's small all-reduce (ring.py's exchange) as a
// TensorFlow op.
//
// Each worker sends its tensors, back to back after a header (this link's collective
// number, the bytes, the dtype), to every other worker, reads theirs, and sums all of
// them in rank order: every worker ends with the same bits, after one round trip. Each
// pair of workers has a socket of its own for it, connected and authenticated as the
// transport's (native_exchange.py). Across hosts, PowerSGD runs three such all-reduces
// per step (its P and Q factors, Keras' logged loss); through the Python path each costs
// a worker ~0.4 ms of CPU and ~1 ms of wall time in thread hand-offs (docs/performance.md).
//
// The sockets are read and written without blocking, from this thread, polling them in
// short slices: between slices the op returns the control block's abort error once it is
// set (native_control.h). A peer that is lost (its socket closed or failed) is left to the
// transport to name: the op says which peer it waits for and wakes the watcher thread,
// which stops the transport with the error its connection to that peer reports (the same
// as on the Python path: the peers are told) and aborts the op. A peer that falls silent
// is named by the watcher as well, once its heartbeats stop for the peer timeout.
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "native_control.h"

namespace tf_distrib {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;

// The header: the link's collective number, the payload's bytes, the dtype's code.
constexpr int kHeaderWords = 3;
constexpr int64_t kHeaderBytes = kHeaderWords * sizeof(int64_t);
// How often the waits look at the abort word.
constexpr int kSliceMs = 10;
// How long a wait retries its sockets before it sleeps in poll: a peer's message mostly
// lands within this, and waking from poll costs a VM's core tens of microseconds.
constexpr int64_t kSpinNs = 100000;
// How long a worker that lost a peer's socket waits for the transport to name the cause
// (its connection to the peer sees the same end within one watcher check).
constexpr int64_t kNameLostNs = 5000000000LL;

template <typename T>
class ExchangeSum : public OpKernel {
 public:
  explicit ExchangeSum(OpKernelConstruction* c) : OpKernel(c) {
    int64_t control;
    OP_REQUIRES_OK(c, c->GetAttr("fds", &fds_));
    OP_REQUIRES_OK(c, c->GetAttr("peers", &peers_));
    OP_REQUIRES_OK(c, c->GetAttr("control", &control));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(c, c->GetAttr("dtype_code", &dtype_code_));
    control_ = reinterpret_cast<int64_t*>(control);
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, Aborted(control_));
    const int world = static_cast<int>(fds_.size()), n = ctx->num_inputs() - 1;
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += ctx->input(1 + i).NumElements();
    const int64_t bytes = total * int64_t{sizeof(T)}, message = kHeaderBytes + bytes;
    Recorded recorded(control_, ctx->input(0).scalar<int64_t>()(), bytes);
    // This worker's message; its payload is also its addend (an output may take its
    // input's buffer).
    std::vector<int64_t> mine((message + sizeof(int64_t) - 1) / sizeof(int64_t));
    mine[0] = Load(control_ + kCollectives);
    mine[1] = bytes;
    mine[2] = dtype_code_;
    char* payload = reinterpret_cast<char*>(mine.data()) + kHeaderBytes;
    int64_t at = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(1 + i);
      std::memcpy(payload + at, t.data(), t.TotalBytes());
      at += t.TotalBytes();
    }
    std::vector<std::vector<int64_t>> theirs(world);
    for (int r = 0; r < world; ++r) {
      if (r != rank_) theirs[r].resize(mine.size());
    }
    OP_REQUIRES_OK(ctx, Exchange(reinterpret_cast<char*>(mine.data()), message, theirs));
    std::vector<const T*> parts(world);
    for (int r = 0; r < world; ++r) {
      parts[r] = reinterpret_cast<const T*>(
          r == rank_ ? payload : reinterpret_cast<const char*>(theirs[r].data()) + kHeaderBytes);
    }
    at = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(1 + i);
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1 + i}, i, t.shape(), &out));
      T* sum = out->flat<T>().data();
      for (int64_t j = at, end = at + t.NumElements(); j < end; ++j) {
        T s = parts[0][j] + parts[1][j];
        for (int r = 2; r < world; ++r) s += parts[r][j];
        sum[j - at] = s;
      }
      at += t.NumElements();
    }
    recorded.Done();
  }

 private:
  // Sends `message` to every peer and reads each one's into `theirs[r]` (as long), at
  // once: no worker's send waits for a read that waits for that send.
  Status Exchange(char* message, int64_t length, std::vector<std::vector<int64_t>>& theirs) {
    const int world = static_cast<int>(fds_.size());
    std::vector<int64_t> sent(world, 0), got(world, 0);
    sent[rank_] = got[rank_] = length;
    std::vector<pollfd> waits;
    int64_t waited = 0;
    const int64_t spin_until = Now() + kSpinNs;
    while (true) {
      waits.clear();
      int waiting_for = -1;
      // Every send first: each peer then has this worker's header before any check fails.
      for (int r = 0; r < world; ++r) {
        if (r != rank_) TF_RETURN_IF_ERROR(Move(r, true, message, length, sent[r]));
      }
      for (int r = 0; r < world; ++r) {
        if (r == rank_) continue;
        char* in = reinterpret_cast<char*>(theirs[r].data());
        const bool had_header = got[r] >= kHeaderBytes;
        TF_RETURN_IF_ERROR(Move(r, false, in, length, got[r]));
        if (!had_header && got[r] >= kHeaderBytes) {
          TF_RETURN_IF_ERROR(Check(r, reinterpret_cast<const int64_t*>(message), theirs[r]));
        }
        const short events = (sent[r] < length ? POLLOUT : 0) | (got[r] < length ? POLLIN : 0);
        if (events) waits.push_back(pollfd{static_cast<int>(fds_[r]), events, 0});
        if (got[r] < length && waiting_for < 0) waiting_for = r;
      }
      if (waits.empty()) break;
      TF_RETURN_IF_ERROR(Aborted(control_));
      Store(control_ + kWaitingFor, waiting_for + 1);
      const int64_t began = Now();
      if (began >= spin_until) poll(waits.data(), waits.size(), kSliceMs);
      waited += Now() - began;
    }
    Store(control_ + kWaitingFor, 0);
    __atomic_add_fetch(control_ + kWaitedNanoseconds, waited, __ATOMIC_RELAXED);
    return ::tensorflow::OkStatus();
  }

  // Sends (or reads) what the socket to peer `r` takes (or has) now of buf[done, length).
  Status Move(int r, bool sending, char* buf, int64_t length, int64_t& done) {
    const int fd = static_cast<int>(fds_[r]);
    while (done < length) {
      const ssize_t moved = sending
          ? send(fd, buf + done, length - done, MSG_DONTWAIT | MSG_NOSIGNAL)
          : recv(fd, buf + done, length - done, MSG_DONTWAIT);
      if (moved > 0) {
        done += moved;
      } else if (moved < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return ::tensorflow::OkStatus();
      } else {
        return Lost(r, moved == 0 ? "closed its connection" : strerror(errno));
      }
    }
    return ::tensorflow::OkStatus();
  }

  // A peer's header must announce this worker's collective.
  Status Check(int r, const int64_t* mine, const std::vector<int64_t>& theirs) const {
    if (theirs[0] == mine[0] && theirs[1] == mine[1] && theirs[2] == mine[2]) {
      return ::tensorflow::OkStatus();
    }
    char name[sizeof(int64_t) + 1] = {}, own[sizeof(int64_t) + 1] = {};
    std::memcpy(name, &theirs[2], sizeof(int64_t));
    std::memcpy(own, &mine[2], sizeof(int64_t));
    return ::tensorflow::errors::Internal(
        "tf_distrib.transport.errors.ProtocolError: ", peers_[r], " runs a different "
        "collective (number ", theirs[0], ", ", theirs[1], " bytes of ", name,
        ") than this worker (number ", mine[0], ", ", mine[1], " bytes of ", own,
        "): the workers do not run the same model or step.");
  }

  // Peer r's socket ended: the transport names the cause (see the top of this file), or,
  // should it not within kNameLostNs, this op does.
  Status Lost(int r, const char* how) {
    Store(control_ + kWaitingFor, r + 1);
    Wake(control_);
    const int64_t began = Now();
    while (!Load(control_ + kAbort) && Now() - began < kNameLostNs) {
      poll(nullptr, 0, 1);
    }
    Store(control_ + kWaitingFor, 0);
    if (Load(control_ + kAbort)) return Aborted(control_);
    return ::tensorflow::errors::Unknown("tf_distrib.transport.errors.PeerLostError: ",
                                         peers_[r], " ", how, " during an all-reduce.");
  }

  std::vector<int64_t> fds_;
  std::vector<std::string> peers_;
  int64_t* control_;
  int64_t rank_, dtype_code_;
};

}  // namespace

REGISTER_OP("TfDistribExchangeSum")
    .Input("ticket: int64")
    .Input("tensors: N * T")
    .Output("sums: N * T")
    .Attr("T: {float, int64}")
    .Attr("N: int >= 1")
    // By rank: each peer's socket and name ("worker:1 (host:port)"); -1 and "" for this one.
    .Attr("fds: list(int) >= 2")
    .Attr("peers: list(string)")
    .Attr("control: int")
    .Attr("rank: int")
    .Attr("dtype_code: int")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 1; i < c->num_inputs(); ++i) c->set_output(i - 1, c->input(i));
      return ::tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(
    Name("TfDistribExchangeSum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    ExchangeSum<float>);
// int64: TensorFlow's per-step count of the workers whose input still has data.
REGISTER_KERNEL_BUILDER(
    Name("TfDistribExchangeSum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("T"),
    ExchangeSum<int64_t>);

}  // namespace tf_distrib
