// Fused attention on CUDA through cuDNN's SDPA graphs (cudnn-frontend): the forward writes Y
// and the per-row log-sum-exp (Stats), the backward recomputes the probabilities from Stats
// tile by tile, so the [Sq, Skv] scores are never written to memory. Interface: sdpa.h.
//
// Built only when build.py finds the cuDNN and cudnn-frontend headers (MPG_WITH_CUDNN); the
// library then links libcudnn.so.9, the one ONNX Runtime's CUDA provider loads too.
//
// A cuDNN graph is built once per shape, dtype, mask and scale (building picks and compiles an
// engine: tens of milliseconds) and kept, with its workspace, for the life of the process.
// The first run of a shape must happen outside CUDA graph capture (ORT runs a session once
// before it captures); replays then only execute.
#ifdef MPG_WITH_CUDNN
// cudnn-frontend reaches cuDNN's graph API through dlsym at run time: it knows calls newer than
// the installed cuDNN (9.19 under torch's CUDA 13 wheels lacks cudnnGetExecutionPlanWorkspaceSize)
// and checks the loaded version before it makes them, where a linked call would fail to load.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "sdpa.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the library cudnn-frontend's dlsym calls read
}  // namespace cudnn_frontend

namespace fe = cudnn_frontend;

namespace {

thread_local std::string g_error;

int fail(const std::string& message) {
  g_error = message;
  return 1;
}

enum Uid : int64_t { kQ = 1, kK, kV, kY, kStats, kDY, kDQ, kDK, kDV };

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  void* workspace = nullptr;
};

std::mutex g_mutex;
std::unordered_map<std::string, std::unique_ptr<Plan>> g_plans;
std::unordered_map<int, cudnnHandle_t> g_handles;

std::vector<int64_t> dims(int64_t b, int64_t h, int64_t s, int64_t d) { return {b, h, s, d}; }
std::vector<int64_t> strides(const int64_t* s) { return {s[0], s[1], s[2], s[3]}; }

// The cache key: every field of the shape (field by field: the struct's padding bytes are not
// initialised), the direction and the device.
std::string key_of(const SdpaShape& s, bool backward, int device) {
  std::string key;
  auto add = [&key](const void* p, size_t n) { key.append(static_cast<const char*>(p), n); };
  const int64_t sizes[] = {s.batch, s.q_heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, s.v_head_dim};
  add(sizes, sizeof(sizes));
  for (const int64_t* stride : {s.q_stride, s.k_stride, s.v_stride, s.y_stride}) add(stride, 4 * sizeof(int64_t));
  const int flags[] = {s.type, s.causal, backward ? 1 : 0, device};
  add(flags, sizeof(flags));
  add(&s.scale, sizeof(s.scale));
  return key;
}

fe::graph::Tensor_attributes tensor(const char* name, int64_t uid, std::vector<int64_t> dim,
                                    std::vector<int64_t> stride) {
  return fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride);
}

std::vector<int64_t> stats_dims(const SdpaShape& s) { return dims(s.batch, s.q_heads, s.q_len, 1); }
std::vector<int64_t> stats_strides(const SdpaShape& s) { return {s.q_heads * s.q_len, s.q_len, 1, 1}; }

std::shared_ptr<fe::graph::Graph> make_graph(const SdpaShape& s, bool backward) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(s.type == 16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto qd = dims(s.batch, s.q_heads, s.q_len, s.head_dim);
  const auto kd = dims(s.batch, s.kv_heads, s.kv_len, s.head_dim);
  const auto vd = dims(s.batch, s.kv_heads, s.kv_len, s.v_head_dim);
  const auto yd = dims(s.batch, s.q_heads, s.q_len, s.v_head_dim);
  auto q = graph->tensor(tensor("Q", kQ, qd, strides(s.q_stride)));
  auto k = graph->tensor(tensor("K", kK, kd, strides(s.k_stride)));
  auto v = graph->tensor(tensor("V", kV, vd, strides(s.v_stride)));
  if (!backward) {
    auto options = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(s.scale);
    if (s.causal) options.set_causal_mask(true);
    auto [y, stats] = graph->sdpa(q, k, v, options);
    y->set_output(true).set_uid(kY).set_dim(yd).set_stride(strides(s.y_stride));
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dims(s)).set_stride(
        stats_strides(s));
    return graph;
  }
  auto y = graph->tensor(tensor("Y", kY, yd, strides(s.y_stride)));
  auto dy = graph->tensor(tensor("dY", kDY, yd, strides(s.y_stride)));
  auto stats = graph->tensor(
      tensor("Stats", kStats, stats_dims(s), stats_strides(s)).set_data_type(fe::DataType_t::FLOAT));
  auto options = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(s.scale);
  if (s.causal) options.set_causal_mask(true);
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, y, dy, stats, options);
  dq->set_output(true).set_uid(kDQ).set_dim(qd).set_stride(strides(s.q_stride));
  dk->set_output(true).set_uid(kDK).set_dim(kd).set_stride(strides(s.k_stride));
  dv->set_output(true).set_uid(kDV).set_dim(vd).set_stride(strides(s.v_stride));
  return graph;
}

// The handle of the current device, bound to ``stream`` (callers hold g_mutex).
int handle_for(cudaStream_t stream, cudnnHandle_t* handle, int* device) {
  if (fe::cudnn_dlhandle == nullptr) {
    // Already loaded (this library links it; ORT's CUDA provider loads it too): this finds it.
    fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (fe::cudnn_dlhandle == nullptr) return fail(std::string("SDPA: cannot load libcudnn.so.9: ") + dlerror());
  }
  if (cudaGetDevice(device) != cudaSuccess) return fail("SDPA: cudaGetDevice failed");
  auto found = g_handles.find(*device);
  if (found == g_handles.end()) {
    cudnnHandle_t created = nullptr;
    if (cudnnStatus_t st = cudnnCreate(&created); st != CUDNN_STATUS_SUCCESS)
      return fail(std::string("SDPA: cudnnCreate failed: ") + cudnnGetErrorString(st));
    found = g_handles.emplace(*device, created).first;
  }
  *handle = found->second;
  if (cudnnStatus_t st = cudnnSetStream(*handle, stream); st != CUDNN_STATUS_SUCCESS)
    return fail(std::string("SDPA: cudnnSetStream failed: ") + cudnnGetErrorString(st));
  return 0;
}

// The built graph for this shape and direction (built and its workspace allocated on first use).
int plan_for(const SdpaShape& s, bool backward, cudnnHandle_t handle, int device, Plan** out) {
  const std::string key = key_of(s, backward, device);
  auto found = g_plans.find(key);
  if (found != g_plans.end()) {
    *out = found->second.get();
    return 0;
  }
  auto plan = std::make_unique<Plan>();
  try {
    plan->graph = make_graph(s, backward);
    auto status = plan->graph->build(handle, {fe::HeurMode_t::A});
    if (!status.is_good())
      return fail(std::string("SDPA: cuDNN has no engine for this attention (") + (backward ? "backward" : "forward") +
                  "): " + status.get_message());
    int64_t bytes = 0;
    status = plan->graph->get_workspace_size(bytes);
    if (!status.is_good()) return fail("SDPA: workspace size: " + status.get_message());
    if (bytes > 0 && cudaMalloc(&plan->workspace, static_cast<size_t>(bytes)) != cudaSuccess)
      return fail("SDPA: cannot allocate " + std::to_string(bytes) + " bytes of workspace");
  } catch (const std::exception& e) {
    return fail(std::string("SDPA: ") + e.what());
  }
  *out = plan.get();
  g_plans.emplace(key, std::move(plan));
  return 0;
}

int run(const SdpaShape* shape, bool backward, std::unordered_map<int64_t, void*>& pack, void* stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  cudnnHandle_t handle = nullptr;
  int device = 0;
  if (int err = handle_for(static_cast<cudaStream_t>(stream), &handle, &device)) return err;
  Plan* plan = nullptr;
  if (int err = plan_for(*shape, backward, handle, device, &plan)) return err;
  try {
    auto status = plan->graph->execute(handle, pack, plan->workspace);
    if (!status.is_good()) return fail("SDPA: execute failed: " + status.get_message());
  } catch (const std::exception& e) {
    return fail(std::string("SDPA: ") + e.what());
  }
  return 0;
}

}  // namespace

extern "C" int mpg_sdpa_forward_cuda(const SdpaShape* shape, const void* q, const void* k, const void* v, void* y,
                                     float* stats, void* stream) {
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)}, {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)}, {kY, y}, {kStats, stats}};
  return run(shape, false, pack, stream);
}

extern "C" int mpg_sdpa_backward_cuda(const SdpaShape* shape, const void* q, const void* k, const void* v,
                                      const void* y, const void* dy, const float* stats, void* dq, void* dk, void* dv,
                                      void* stream) {
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(q)},  {kK, const_cast<void*>(k)},          {kV, const_cast<void*>(v)},
      {kY, const_cast<void*>(y)},  {kDY, const_cast<void*>(dy)},        {kStats, const_cast<float*>(stats)},
      {kDQ, dq},                   {kDK, dk},                           {kDV, dv}};
  return run(shape, true, pack, stream);
}

extern "C" const char* mpg_sdpa_last_error() { return g_error.c_str(); }

#endif  // MPG_WITH_CUDNN
