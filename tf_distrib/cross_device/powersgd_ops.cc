// PowerSGD's arithmetic as TensorFlow ops (powersgd.py's `_Kernels`).
//
// Each works on N matrices at once (a gradient reshaped to n x m; Q stored transposed,
// r x m, so that every inner loop runs along a row of m contiguous floats):
//   TfDistribPowerSgdProject      M = G + E and P = M Q, in one pass over the row, M
//                                 written over the previous M held in a variable
//   TfDistribPowerSgdOrthonormalize  P̂: P's columns by Gram-Schmidt (double, twice)
//   TfDistribPowerSgdBack         Q' = M^T P̂, by fixed blocks of rows summed in order
//   TfDistribPowerSgdRebuild      the sum A = P̂ Q'^T
//   TfDistribPowerSgdRebuildSgd   Keras' SGD step on A (with or without momentum) into
//                                 the variables; A is never written
// The residual E = M - A * scale is never stored either: the variable keeps M, P̂ and Q'
// stay, and the next Project rebuilds E's row from them as it reads it (a rank-r product
// in cache). Six passes over the gradient's size per SGD step in all (G, M; M; M; the
// weights, twice), where TensorFlow's matmuls, adds, assigns and Keras' update take
// about eighteen and an op each (docs/gradients.md has the measured times).
//
// Why not tf.matmul and tf.linalg.qr: every worker rebuilds A from the same sums, and
// must get the same bits, or the workers' weights drift apart. oneDNN and Eigen pick
// their kernels (and so their order of additions) by the CPU they run on; here each
// output element is summed in an order fixed by the code, with no fused multiply-adds
// (-ffp-contract=off, native_build.py), in 16-lane vectors that the compiler splits into
// AVX2 or SSE2 parts where AVX-512 is missing: the same bits on any x86-64 (or other) host.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"
#include "../transport/native_update.h"

namespace tf_distrib {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpInputList;
using ::tensorflow::OpOutputList;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

// A scalar enters vector arithmetic as a plain float (`v * x`), which GCC broadcasts
// once; a 16-value initialiser {x, x, ...} costs sixteen masked broadcasts in the AVX-512
// clone, as many instructions as the products it feeds.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
// Rows per block of TfDistribPowerSgdBack: its partial sums are added in block order.
constexpr int64_t kBlockRows = 64;

inline v16 Load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline float Sum(v16 v) {
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}
// p[k] = row M_i . row k of Q^T for K rows of Q^T from qt, each summed in j's order; K
// known at compile time keeps the K sums in registers. Always inlined: a call would run
// the default (SSE2) build, not the caller's AVX-512 or AVX2 clone.
template <int K>
__attribute__((always_inline)) inline void RowTimesQ(const float* mi, const float* qt,
                                                     float* p, int64_t m) {
  const int64_t body = m / kLanes * kLanes;
  v16 acc[K] = {};
  for (int64_t j = 0; j < body; j += kLanes) {
    const v16 v = Load(mi + j);
    for (int k = 0; k < K; ++k) acc[k] += v * Load(qt + k * m + j);
  }
  for (int k = 0; k < K; ++k) {
    float s = Sum(acc[k]);
    for (int64_t j = body; j < m; ++j) s += mi[j] * qt[k * m + j];
    p[k] = s;
  }
}

// Row i of A = P̂ Q'^T into a_row, each element summed in k's order: eight vectors at a
// time held in registers through the r products (one store each, no reloads).
VECTOR_CLONES void ApproximateRow(const float* p, const float* qt, float* a_row, int64_t m,
                                  int64_t r, int64_t i) {
  constexpr int64_t kChunk = 8;
  const float* pi = p + i * r;
  const int64_t body = m / (kChunk * kLanes) * (kChunk * kLanes);
  for (int64_t j = 0; j < body; j += kChunk * kLanes) {
    v16 a[kChunk];
    const float p0 = pi[0];
    for (int64_t c = 0; c < kChunk; ++c) a[c] = p0 * Load(qt + j + c * kLanes);
    for (int64_t k = 1; k < r; ++k) {
      const float pk = pi[k];
      const float* qk = qt + k * m + j;
      for (int64_t c = 0; c < kChunk; ++c) a[c] += pk * Load(qk + c * kLanes);
    }
    for (int64_t c = 0; c < kChunk; ++c) Store(a_row + j + c * kLanes, a[c]);
  }
  for (int64_t j = body; j < m; ++j) {
    float a = pi[0] * qt[j];
    for (int64_t k = 1; k < r; ++k) a += pi[k] * qt[k * m + j];
    a_row[j] = a;
  }
}

// Rows [begin, end) of M = G + E, E = M_previous - A_previous * scale (A_previous = P̂
// Q^T: the factors of the previous step), and P = M Q (qt: r x m). m_out may be
// m_previous: each element is read before it is written.
VECTOR_CLONES void ProjectRows(const float* g, const float* m_previous, float* m_out,
                               const float* p_hat, const float* qt, float scale, float* p,
                               float* a_row, int64_t m, int64_t r, int64_t begin,
                               int64_t end) {
  const int64_t body = m / kLanes * kLanes;
  for (int64_t i = begin; i < end; ++i) {
    const float* gi = g + i * m;
    const float* ei = m_previous + i * m;
    float* mi = m_out + i * m;
    ApproximateRow(p_hat, qt, a_row, m, r, i);
    for (int64_t j = 0; j < body; j += kLanes) {
      Store(mi + j, Load(gi + j) + (Load(ei + j) - Load(a_row + j) * scale));
    }
    for (int64_t j = body; j < m; ++j) mi[j] = gi[j] + (ei[j] - a_row[j] * scale);
    for (int64_t k0 = 0; k0 < r; k0 += 4) {
      const float* q = qt + k0 * m;
      float* pi = p + i * r + k0;
      switch (r - k0) {
        case 1: RowTimesQ<1>(mi, q, pi, m); break;
        case 2: RowTimesQ<2>(mi, q, pi, m); break;
        case 3: RowTimesQ<3>(mi, q, pi, m); break;
        default: RowTimesQ<4>(mi, q, pi, m);
      }
    }
  }
}

// Adds four rows of M (mi) times their P̂ values (p: the first row's P̂ value k0, rows r
// apart) into K rows of Q'^T from q: each row of M is loaded once for the K products,
// each element of q once per four rows, summed in row order.
template <int K>
__attribute__((always_inline)) inline void FourRowsBack(const float* const mi[4],
                                                        const float* p, int64_t r, float* q,
                                                        int64_t m) {
  const int64_t body = m / kLanes * kLanes;
  float pv[4][K];
  for (int t = 0; t < 4; ++t) {
    for (int k = 0; k < K; ++k) pv[t][k] = p[t * r + k];
  }
  for (int64_t j = 0; j < body; j += kLanes) {
    const v16 m0 = Load(mi[0] + j), m1 = Load(mi[1] + j), m2 = Load(mi[2] + j),
              m3 = Load(mi[3] + j);
    for (int k = 0; k < K; ++k) {
      v16 a = Load(q + k * m + j);
      a += m0 * pv[0][k];
      a += m1 * pv[1][k];
      a += m2 * pv[2][k];
      a += m3 * pv[3][k];
      Store(q + k * m + j, a);
    }
  }
  for (int64_t j = body; j < m; ++j) {
    for (int k = 0; k < K; ++k) {
      for (int t = 0; t < 4; ++t) q[k * m + j] += mi[t][j] * pv[t][k];
    }
  }
}

// qt_out (r x m) = rows [begin, end) of M, transposed, times P̂: each element summed in
// row order.
VECTOR_CLONES void BackRows(const float* mm, const float* p, float* qt_out, int64_t m,
                            int64_t r, int64_t begin, int64_t end) {
  const int64_t body = m / kLanes * kLanes;
  std::memset(qt_out, 0, sizeof(float) * r * m);
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    const float* const mi[4] = {mm + i * m, mm + (i + 1) * m, mm + (i + 2) * m,
                                mm + (i + 3) * m};
    for (int64_t k0 = 0; k0 < r; k0 += 4) {
      const float* pk = p + i * r + k0;
      float* q = qt_out + k0 * m;
      switch (r - k0) {
        case 1: FourRowsBack<1>(mi, pk, r, q, m); break;
        case 2: FourRowsBack<2>(mi, pk, r, q, m); break;
        case 3: FourRowsBack<3>(mi, pk, r, q, m); break;
        default: FourRowsBack<4>(mi, pk, r, q, m);
      }
    }
  }
  for (; i < end; ++i) {  // the last rows of a block whose size is no multiple of four
    const float* mi = mm + i * m;
    for (int64_t k = 0; k < r; ++k) {
      const float pv = p[i * r + k];
      float* qk = qt_out + k * m;
      for (int64_t j = 0; j < body; j += kLanes) {
        Store(qk + j, Load(qk + j) + Load(mi + j) * pv);
      }
      for (int64_t j = body; j < m; ++j) qk[j] += mi[j] * pv;
    }
  }
}

// Keras' SGD step's arguments (native_update.h has its arithmetic).
struct SgdStep {
  float rate = 0, momentum = 0;
  bool with_momentum = false, nesterov = false;
};

// Rows [begin, end) of Keras' SGD step on A: the weights (w_in -> w_out) and velocities
// (v_in -> v_out, with momentum). A's row lives in `a_row`. Each new value may overwrite
// its old one (an element is read before it is written).
VECTOR_CLONES void SgdRows(const float* p, const float* qt, const float* w_in, float* w_out,
                           const float* v_in, float* v_out, SgdStep step, float* a_row,
                           int64_t m, int64_t r, int64_t begin, int64_t end) {
  const int64_t body = m / kLanes * kLanes;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t at = i * m;
    ApproximateRow(p, qt, a_row, m, r, i);
    for (int64_t j = 0; j < body; j += kLanes) {
      const v16 a = Load(a_row + j), w = Load(w_in + at + j);
      if (!step.with_momentum) {
        Store(w_out + at + j, SgdWeight(w, a, step.rate));
        continue;
      }
      v16 v;
      Store(w_out + at + j, MomentumWeight(w, Load(v_in + at + j), a, step.rate,
                                           step.momentum, step.nesterov, &v));
      Store(v_out + at + j, v);
    }
    for (int64_t j = body; j < m; ++j) {
      if (!step.with_momentum) {
        w_out[at + j] = SgdWeight(w_in[at + j], a_row[j], step.rate);
        continue;
      }
      w_out[at + j] = MomentumWeight(w_in[at + j], v_in[at + j], a_row[j], step.rate,
                                     step.momentum, step.nesterov, &v_out[at + j]);
    }
  }
}

// Runs work(begin, end) over [0, rows) on the op's intra-op threads. The outputs of a
// row never depend on how the rows were split.
template <typename Work>
void ForRows(OpKernelContext* ctx, int64_t rows, int64_t cost_per_row, Work work) {
  auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(threads->num_threads, threads->workers, rows, cost_per_row, work);
}

int64_t Rows(const Tensor& t) { return t.dim_size(0); }
int64_t Cols(const Tensor& t) { return t.dim_size(1); }

// The variables of resource inputs [first, first + count), looked up; empty on error.
std::vector<::tensorflow::core::RefCountPtr<::tensorflow::Var>> Variables(
    OpKernelContext* ctx, int first, int count) {
  std::vector<::tensorflow::core::RefCountPtr<::tensorflow::Var>> variables(count);
  for (int j = 0; j < count; ++j) {
    const auto status = ::tensorflow::LookupResource(
        ctx, ::tensorflow::HandleFromInput(ctx, first + j), &variables[j]);
    if (!status.ok()) {
      ctx->SetStatus(status);
      return {};
    }
  }
  return variables;
}

// A variable's value, written in place where nothing else holds its buffer (else into a
// new one that the variable takes afterwards: a read of the old value keeps it).
class Updated {
 public:
  Updated(OpKernelContext* ctx, ::tensorflow::Var* variable, int64_t elements, int i)
      : variable_(variable), old_(*variable->tensor()) {
    OP_REQUIRES(ctx, variable->is_initialized && old_.dtype() == ::tensorflow::DT_FLOAT &&
                         old_.NumElements() == elements,
                ::tensorflow::errors::InvalidArgument(
                    "the variable of matrix ", i, " is ", old_.DebugString(),
                    ", not an initialized float32 of ", elements, " values"));
    if (!variable->copy_on_read_mode.load() && OnlyTheVariableHolds(old_)) {
      new_ = old_;
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, old_.shape(), &new_));
      fresh_ = true;
    }
  }
  const float* in() const { return old_.flat<float>().data(); }
  float* out() { return new_.flat<float>().data(); }
  void Assign() {
    if (fresh_) *variable_->tensor() = new_;
  }

 private:
  ::tensorflow::Var* variable_;
  Tensor old_, new_;
  bool fresh_ = false;
};

class ProjectOp : public OpKernel {
 public:
  explicit ProjectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList grads, p_hats, qts;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("p_hats", &p_hats));
    OP_REQUIRES_OK(ctx, ctx->input_list("qts", &qts));
    const int n = grads.size();
    const float scale = ctx->input(4 * n).scalar<float>()();
    const auto matrices = Variables(ctx, n, n);
    if (!ctx->status().ok()) return;
    const Locked locked(matrices);
    OpOutputList ps;
    OP_REQUIRES_OK(ctx, ctx->output_list("ps", &ps));
    for (int i = 0; i < n; ++i) {
      const Tensor& g = grads[i];
      OP_REQUIRES(ctx, g.dims() == 2 && qts[i].dims() == 2 && Cols(qts[i]) == Cols(g) &&
                           p_hats[i].dims() == 2 && Rows(p_hats[i]) == Rows(g) &&
                           Cols(p_hats[i]) == Rows(qts[i]),
                  ::tensorflow::errors::InvalidArgument(
                      "matrix ", i, ": gradient ", g.shape().DebugString(), ", P̂ ",
                      p_hats[i].shape().DebugString(), ", Q^T ",
                      qts[i].shape().DebugString()));
      Updated matrix(ctx, matrices[i].get(), g.NumElements(), i);
      if (!ctx->status().ok()) return;
      Tensor* p = nullptr;
      OP_REQUIRES_OK(ctx, ps.allocate(i, TensorShape({Rows(g), Rows(qts[i])}), &p));
      const int64_t m = Cols(g), r = Rows(qts[i]);
      const float *gp = g.flat<float>().data(), *hp = p_hats[i].flat<float>().data(),
                  *qp = qts[i].flat<float>().data();
      float* pp = p->flat<float>().data();
      ForRows(ctx, Rows(g), m * (4 + 4 * r), [&](int64_t begin, int64_t end) {
        std::vector<float> a_row(m);
        ProjectRows(gp, matrix.in(), matrix.out(), hp, qp, scale, pp, a_row.data(), m, r,
                    begin, end);
      });
      matrix.Assign();
    }
  }
};

class OrthonormalizeOp : public OpKernel {
 public:
  explicit OrthonormalizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList ps;
    OP_REQUIRES_OK(ctx, ctx->input_list("ps", &ps));
    OpOutputList outs;
    OP_REQUIRES_OK(ctx, ctx->output_list("p_hats", &outs));
    for (int i = 0; i < ps.size(); ++i) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, outs.allocate(i, ps[i].shape(), &out));
      const int64_t n = Rows(ps[i]), r = Cols(ps[i]);
      const float* in = ps[i].flat<float>().data();
      float* q = out->flat<float>().data();
      // Gram-Schmidt in double, each column orthogonalised twice ("twice is enough":
      // once leaves a nearly dependent column's remainder far from orthogonal, and P̂
      // P̂^T would then be no projection). A zero column (a zero gradient's) stays zeros.
      std::vector<double> w(in, in + n * r);
      for (int64_t k = 0; k < r; ++k) {
        for (int pass = 0; pass < 2; ++pass) {
          for (int64_t l = 0; l < k; ++l) {
            double dot = 0;
            for (int64_t row = 0; row < n; ++row) dot += w[row * r + k] * w[row * r + l];
            for (int64_t row = 0; row < n; ++row) w[row * r + k] -= dot * w[row * r + l];
          }
        }
        double norm = 0;
        for (int64_t row = 0; row < n; ++row) norm += w[row * r + k] * w[row * r + k];
        const double inverse = norm > 0 ? 1.0 / std::sqrt(norm) : 0.0;
        for (int64_t row = 0; row < n; ++row) w[row * r + k] *= inverse;
      }
      for (int64_t j = 0; j < n * r; ++j) q[j] = static_cast<float>(w[j]);
    }
  }
};

class BackOp : public OpKernel {
 public:
  explicit BackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList matrices, p_hats;
    OP_REQUIRES_OK(ctx, ctx->input_list("matrices", &matrices));
    OP_REQUIRES_OK(ctx, ctx->input_list("p_hats", &p_hats));
    OpOutputList qts;
    OP_REQUIRES_OK(ctx, ctx->output_list("qts", &qts));
    for (int i = 0; i < matrices.size(); ++i) {
      const int64_t n = Rows(matrices[i]), m = Cols(matrices[i]), r = Cols(p_hats[i]);
      OP_REQUIRES(ctx, Rows(p_hats[i]) == n,
                  ::tensorflow::errors::InvalidArgument("matrix ", i, ": P has ",
                                                        Rows(p_hats[i]), " rows, M ", n));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, qts.allocate(i, TensorShape({r, m}), &out));
      // One partial Q' per block of rows, added in block order: the same bits however
      // many threads ran the blocks.
      const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
      std::vector<float> partial(blocks * r * m);
      const float *mp = matrices[i].flat<float>().data(), *pp = p_hats[i].flat<float>().data();
      ForRows(ctx, blocks, kBlockRows * m * 2 * r, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          BackRows(mp, pp, partial.data() + b * r * m, m, r, b * kBlockRows,
                   std::min(n, (b + 1) * kBlockRows));
        }
      });
      float* q = out->flat<float>().data();
      std::memcpy(q, partial.data(), sizeof(float) * r * m);
      for (int64_t b = 1; b < blocks; ++b) {
        const float* part = partial.data() + b * r * m;
        for (int64_t j = 0; j < r * m; ++j) q[j] += part[j];
      }
    }
  }
};

class RebuildOp : public OpKernel {
 public:
  explicit RebuildOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList p_hats, qts;
    OP_REQUIRES_OK(ctx, ctx->input_list("p_hats", &p_hats));
    OP_REQUIRES_OK(ctx, ctx->input_list("qts", &qts));
    OpOutputList approximations;
    OP_REQUIRES_OK(ctx, ctx->output_list("approximations", &approximations));
    for (int i = 0; i < p_hats.size(); ++i) {
      const int64_t n = Rows(p_hats[i]), m = Cols(qts[i]), r = Rows(qts[i]);
      Tensor* a = nullptr;
      OP_REQUIRES_OK(ctx, approximations.allocate(i, TensorShape({n, m}), &a));
      const float *pp = p_hats[i].flat<float>().data(), *qp = qts[i].flat<float>().data();
      float* ap = a->flat<float>().data();
      ForRows(ctx, n, m * 2 * r, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) ApproximateRow(pp, qp, ap + row * m, m, r, row);
      });
    }
  }
};

class RebuildSgdOp : public OpKernel {
 public:
  explicit RebuildSgdOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("nesterov", &nesterov_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList p_hats, qts;
    OP_REQUIRES_OK(ctx, ctx->input_list("p_hats", &p_hats));
    OP_REQUIRES_OK(ctx, ctx->input_list("qts", &qts));
    const int n = p_hats.size();
    SgdStep step;
    step.rate = ctx->input(2 * n).scalar<float>()();
    step.momentum = ctx->input(2 * n + 1).scalar<float>()();
    step.nesterov = nesterov_;
    // Weights (variable i), then velocities (n + i).
    const int first = 2 * n + 2, count = ctx->num_inputs() - first;
    step.with_momentum = count == 2 * n;
    const auto variables = Variables(ctx, first, count);
    if (!ctx->status().ok()) return;
    const Locked locked(variables);
    for (int i = 0; i < n; ++i) {
      const int64_t rows = Rows(p_hats[i]), m = Cols(qts[i]), r = Rows(qts[i]);
      Updated weights(ctx, variables[i].get(), rows * m, i);
      if (!ctx->status().ok()) return;
      std::unique_ptr<Updated> velocities;
      if (step.with_momentum) {
        velocities = std::make_unique<Updated>(ctx, variables[n + i].get(), rows * m, i);
        if (!ctx->status().ok()) return;
      }
      const float *pp = p_hats[i].flat<float>().data(), *qp = qts[i].flat<float>().data();
      ForRows(ctx, rows, m * (2 * r + 4), [&](int64_t begin, int64_t end) {
        std::vector<float> a_row(m);
        SgdRows(pp, qp, weights.in(), weights.out(), velocities ? velocities->in() : nullptr,
                velocities ? velocities->out() : nullptr, step, a_row.data(), m, r, begin,
                end);
      });
      weights.Assign();
      if (velocities) velocities->Assign();
    }
  }

 private:
  bool nesterov_ = false;
};

}  // namespace

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfDistribPowerSgdProject")
    .Input("grads: N * float")
    .Input("matrices: N * resource")
    .Input("p_hats: N * float")
    .Input("qts: N * float")
    .Input("scale: float")
    .Output("ps: N * float")
    .Attr("N: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      const int n = (c->num_inputs() - 1) / 4;
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->Matrix(c->Dim(c->input(i), 0), c->Dim(c->input(3 * n + i), 0)));
      }
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribPowerSgdOrthonormalize")
    .Input("ps: N * float")
    .Output("p_hats: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribPowerSgdBack")
    .Input("matrices: N * float")
    .Input("p_hats: N * float")
    .Output("qts: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() / 2;
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->Matrix(c->Dim(c->input(n + i), 1), c->Dim(c->input(i), 1)));
      }
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribPowerSgdRebuild")
    .Input("p_hats: N * float")
    .Input("qts: N * float")
    .Output("approximations: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() / 2;
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->Matrix(c->Dim(c->input(i), 0), c->Dim(c->input(n + i), 1)));
      }
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribPowerSgdRebuildSgd")
    .Input("p_hats: N * float")
    .Input("qts: N * float")
    .Input("learning_rate: float")
    .Input("momentum: float")
    .Input("weights: N * resource")
    .Input("velocities: V * resource")
    .Attr("N: int >= 1")
    .Attr("V: int >= 0")
    .Attr("nesterov: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext*) { return ::tensorflow::OkStatus(); });

REGISTER_KERNEL_BUILDER(Name("TfDistribPowerSgdProject").Device(::tensorflow::DEVICE_CPU),
                        ProjectOp);
REGISTER_KERNEL_BUILDER(
    Name("TfDistribPowerSgdOrthonormalize").Device(::tensorflow::DEVICE_CPU), OrthonormalizeOp);
REGISTER_KERNEL_BUILDER(Name("TfDistribPowerSgdBack").Device(::tensorflow::DEVICE_CPU), BackOp);
REGISTER_KERNEL_BUILDER(Name("TfDistribPowerSgdRebuild").Device(::tensorflow::DEVICE_CPU),
                        RebuildOp);
REGISTER_KERNEL_BUILDER(Name("TfDistribPowerSgdRebuildSgd").Device(::tensorflow::DEVICE_CPU),
                        RebuildSgdOp);

}  // namespace tf_distrib
