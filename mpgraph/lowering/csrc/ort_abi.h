// The slice of ONNX Runtime's C ABI that mpgraph's kernels use.
//
// ORT's C API is a table of function pointers (``OrtApi``) that only ever grows at its end, and
// a custom op is a struct of callbacks (``OrtCustomOp``) read up to its ``version``: both are a
// stable ABI. Rather than depend on ORT's development headers (its Python wheels ship none),
// this file names the few table slots we call by their index and lays out the callback struct
// field by field. tests/test_kernels.py checks the slot indices against the ORT it runs with.
#pragma once
#include <stddef.h>
#include <stdint.h>

extern "C" {

struct OrtStatus;
struct OrtValue;
struct OrtKernelContext;
struct OrtKernelInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;
struct OrtApi;  // opaque: a table of function pointers, indexed below

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
};

// The API version we ask for: what the slots and callbacks below need (ORT 1.17 and later).
enum { MPG_ORT_API_VERSION = 17 };

// Element types (ONNX TensorProto.DataType numbers).
enum { MPG_FLOAT = 1, MPG_FLOAT16 = 10, MPG_DOUBLE = 11, MPG_BFLOAT16 = 16 };
enum { MPG_ORT_FAIL = 1, MPG_ORT_INVALID_ARGUMENT = 2 };

// Slot indices in OrtApi.
enum MpgOrtSlot {
  kCreateStatus = 0,
  kGetErrorCode = 1,
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomain_Add = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetTensorElementType = 60,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorShapeElementCount = 64,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttribute_float = 85,
  kKernelInfoGetAttribute_int64 = 86,
  kKernelInfoGetAttribute_string = 87,
  kKernelContext_GetInputCount = 88,
  kKernelContext_GetOutputCount = 89,
  kKernelContext_GetInput = 90,
  kKernelContext_GetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kHasValue = 192,
  kKernelContext_GetGPUComputeStream = 193,
  kKernelContext_ParallelFor = 274,
};

// The callbacks of a custom op, in ORT's order (``version`` says how many ORT may read).
struct MpgCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const MpgCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const MpgCustomOp* op);
  const char* (*GetExecutionProviderType)(const MpgCustomOp* op);
  int (*GetInputType)(const MpgCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const MpgCustomOp* op);
  int (*GetOutputType)(const MpgCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const MpgCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const MpgCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const MpgCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const MpgCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const MpgCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const MpgCustomOp* op);
  int (*GetVariadicOutputMinArity)(const MpgCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const MpgCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const MpgCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
  OrtStatus* (*InferOutputShapeFn)(const MpgCustomOp* op, void* shape_infer_context);
  int (*GetStartVersion)(const MpgCustomOp* op);
  int (*GetEndVersion)(const MpgCustomOp* op);
  // Version 18 on (ORT 1.18): which outputs may take an input's buffer when this node is the
  // input's last reader and the sizes match (ORT's allocation planner decides; arrays the op
  // allocates and frees), and which alias one (none here).
  size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
};

// The op version that has the in-place callbacks above; older ORTs get MPG_ORT_API_VERSION.
enum { MPG_ORT_INPLACE_VERSION = 18 };

}  // extern "C"

// Typed access to one slot of the table.
template <typename Fn>
inline Fn mpg_slot(const OrtApi* api, MpgOrtSlot slot) {
  return reinterpret_cast<Fn>(reinterpret_cast<void* const*>(api)[slot]);
}
