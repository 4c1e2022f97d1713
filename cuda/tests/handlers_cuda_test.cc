// Drives the CUDA FFI handlers through hand-built XLA_FFI_CallFrames and a
// minimal XLA_FFI_Api (error objects and the stream only): checks the
// command-buffer trait, the operand/attribute binding, and that malformed
// operands give INVALID_ARGUMENT naming the operand. The validation cases
// need no GPU; with a GPU it also runs one pack and one combine end to end,
// recorded into a CUDA graph and then eagerly.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "handlers_cuda.h"
#include "xla/ffi/api/c_api.h"

// The C API leaves the error type opaque; this harness plays XLA's part.
struct XLA_FFI_Error {
  XLA_FFI_Error_Code errc;
  std::string message;
};

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                  \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

namespace {

cudaStream_t g_stream = nullptr;

XLA_FFI_Error* ErrorCreate(XLA_FFI_Error_Create_Args* a) {
  return new XLA_FFI_Error{a->errc, a->message ? a->message : ""};
}
void ErrorGetDetails(XLA_FFI_Error_GetDetails_Args* a) {
  a->message = a->error->message.c_str();
  a->errc = a->error->errc;
}
void ErrorDestroy(XLA_FFI_Error_Destroy_Args* a) { delete a->error; }
XLA_FFI_Error* StreamGet(XLA_FFI_Stream_Get_Args* a) {
  a->stream = g_stream;
  return nullptr;
}

XLA_FFI_Api MakeApi() {
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof api);
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = {XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR,
                     XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = ErrorCreate;
  api.XLA_FFI_Error_GetDetails = ErrorGetDetails;
  api.XLA_FFI_Error_Destroy = ErrorDestroy;
  api.XLA_FFI_Stream_Get = StreamGet;
  return api;
}
const XLA_FFI_Api kApi = MakeApi();

struct Buf {
  XLA_FFI_DataType dtype;
  std::vector<int64_t> dims;
  void* data = nullptr;
  XLA_FFI_Buffer ffi{};
};

struct Attr {
  std::string name;
  int64_t value;
  XLA_FFI_DataType dtype = XLA_FFI_DataType_S64;
};

// Builds the call frame XLA would pass (attributes sorted by name).
struct Call {
  std::vector<Buf> args, rets;
  std::vector<Attr> attrs;

  XLA_FFI_Error* Run(XLA_FFI_Handler* handler,
                     XLA_FFI_InternalExtension* extension = nullptr) {
    std::vector<XLA_FFI_ArgType> arg_types;
    std::vector<void*> arg_ptrs;
    for (Buf& b : args) {
      b.ffi = {XLA_FFI_Buffer_STRUCT_SIZE, nullptr, b.dtype, b.data,
               static_cast<int64_t>(b.dims.size()), b.dims.data()};
      arg_types.push_back(XLA_FFI_ArgType_BUFFER);
      arg_ptrs.push_back(&b.ffi);
    }
    std::vector<XLA_FFI_RetType> ret_types;
    std::vector<void*> ret_ptrs;
    for (Buf& b : rets) {
      b.ffi = {XLA_FFI_Buffer_STRUCT_SIZE, nullptr, b.dtype, b.data,
               static_cast<int64_t>(b.dims.size()), b.dims.data()};
      ret_types.push_back(XLA_FFI_RetType_BUFFER);
      ret_ptrs.push_back(&b.ffi);
    }
    std::vector<Attr> sorted = attrs;
    std::sort(sorted.begin(), sorted.end(),
              [](const Attr& a, const Attr& b) { return a.name < b.name; });
    std::vector<XLA_FFI_ByteSpan> spans;
    std::vector<XLA_FFI_Scalar> scalars;
    spans.reserve(sorted.size());
    scalars.reserve(sorted.size());
    std::vector<XLA_FFI_AttrType> attr_types;
    std::vector<XLA_FFI_ByteSpan*> names;
    std::vector<void*> attr_ptrs;
    for (Attr& a : sorted) {
      spans.push_back({a.name.data(), a.name.size()});
      scalars.push_back({a.dtype, &a.value});
      attr_types.push_back(XLA_FFI_AttrType_SCALAR);
      names.push_back(&spans.back());
      attr_ptrs.push_back(&scalars.back());
    }
    XLA_FFI_CallFrame frame;
    std::memset(&frame, 0, sizeof frame);
    frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    frame.extension_start = extension;
    frame.api = &kApi;
    frame.ctx = nullptr;
    frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
    frame.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr,
                  static_cast<int64_t>(args.size()), arg_types.data(), arg_ptrs.data()};
    frame.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr,
                  static_cast<int64_t>(rets.size()), ret_types.data(), ret_ptrs.data()};
    frame.attrs = {XLA_FFI_Attrs_STRUCT_SIZE, nullptr,
                   static_cast<int64_t>(sorted.size()), attr_types.data(),
                   names.data(), attr_ptrs.data()};
    return handler(&frame);
  }
};

// Fake (never dereferenced) device addresses for the validation cases.
void* Fake(uintptr_t i) { return reinterpret_cast<void*>(0x10000 * (i + 1)); }

Call PackCall(XLA_FFI_DataType dt, int64_t T, int64_t H, int64_t k, int64_t P,
              int64_t cap, int64_t spill) {
  Call c;
  c.args = {{dt, {T, H}, Fake(0)},
            {XLA_FFI_DataType_S32, {T * k}, Fake(1)},
            {XLA_FFI_DataType_S32, {P}, Fake(2)},
            {XLA_FFI_DataType_S32, {P}, Fake(3)}};
  c.rets = {{dt, {P, cap, H}, Fake(4)}, {dt, {P, spill, H}, Fake(5)}};
  c.attrs = {{"top_k", k}, {"start", 0}, {"capacity", cap}, {"spill_capacity", spill}};
  return c;
}

Call CombineCall(XLA_FFI_DataType in, XLA_FFI_DataType out, int64_t T, int64_t H,
                 int64_t k, int64_t P, int64_t C, int64_t S) {
  Call c;
  c.args = {{in, {P, C, H}, Fake(0)},
            {in, {P, S, H}, Fake(1)},
            {XLA_FFI_DataType_S32, {T * k}, Fake(2)},
            {XLA_FFI_DataType_S32, {T * k}, Fake(3)},
            {XLA_FFI_DataType_F32, {T, k}, Fake(4)}};
  c.rets = {{out, {T, H}, Fake(5)}};
  c.attrs = {{"start", 0}};
  return c;
}

int g_passed = 0;

// Expects INVALID_ARGUMENT whose message contains `needle`.
void ExpectInvalid(XLA_FFI_Error* err, const char* needle, const char* what) {
  if (err == nullptr) {
    std::fprintf(stderr, "FAIL %s: handler accepted the call\n", what);
    std::exit(1);
  }
  if (err->errc != XLA_FFI_Error_Code_INVALID_ARGUMENT ||
      err->message.find(needle) == std::string::npos) {
    std::fprintf(stderr, "FAIL %s: got code %d message \"%s\", want \"%s\"\n", what,
                 static_cast<int>(err->errc), err->message.c_str(), needle);
    std::exit(1);
  }
  delete err;
  ++g_passed;
}

void TestTraits(XLA_FFI_Handler* handler, const char* what) {
  XLA_FFI_Metadata metadata;
  std::memset(&metadata, 0, sizeof metadata);
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension ext;
  ext.extension_base = {XLA_FFI_Metadata_Extension_STRUCT_SIZE,
                        XLA_FFI_Extension_Metadata, nullptr};
  ext.metadata = &metadata;
  Call c;
  XLA_FFI_Error* err = c.Run(handler, &ext.extension_base);
  CHECK(err == nullptr);
  if (!(metadata.traits & XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE)) {
    std::fprintf(stderr, "FAIL %s: not marked command-buffer compatible\n", what);
    std::exit(1);
  }
  ++g_passed;
}

void TestValidation() {
  const auto BF16 = XLA_FFI_DataType_BF16;
  const auto F32 = XLA_FFI_DataType_F32;
  const auto S32 = XLA_FFI_DataType_S32;
  {
    Call c = PackCall(XLA_FFI_DataType_F64, 4, 8, 2, 2, 3, 1);
    c.rets[0].dtype = c.rets[1].dtype = XLA_FFI_DataType_F64;
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`x`", "pack x f64");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.args[0].dims = {32};
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`x`", "pack x rank 1");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.args[1].dims = {7};
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`sorted_slots`", "pack N != T*k");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.args[1].dtype = XLA_FFI_DataType_S64;
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`sorted_slots`", "pack slots s64");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.args[2].dims = {2, 1};
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`send_offsets`", "pack offsets rank 2");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.args[3].dims = {3};
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`send_counts`", "pack counts [3]");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.rets[0].dims = {2, 4, 8};
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`cap_buf", "pack cap rows");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.rets[1].dtype = F32;
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`spill_buf", "pack spill dtype");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.attrs[0].value = 0;
    c.args[1].dims = {0};
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`top_k`", "pack top_k 0");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.attrs[1].value = -1;
    ExpectInvalid(c.Run(MoeJaxPackCuda), "`start`", "pack start -1");
  }
  {
    Call c = PackCall(BF16, 4, 8, 2, 2, 3, 1);
    c.attrs.pop_back();
    ExpectInvalid(c.Run(MoeJaxPackCuda), "attributes", "pack missing attribute");
  }
  {
    Call c = CombineCall(XLA_FFI_DataType_S32, F32, 4, 8, 2, 2, 3, 1);
    c.args[1].dtype = XLA_FFI_DataType_S32;
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`cap_ret`", "combine cap s32");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.args[1].dtype = F32;
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`spill_ret`", "combine spill dtype");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.args[1].dims = {2, 1, 16};
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`spill_ret`", "combine spill H");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.args[2].dims = {9};
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`dest`", "combine dest [9]");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.args[3].dtype = XLA_FFI_DataType_U32;
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`pos`", "combine pos u32");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.args[4].dtype = BF16;
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`weights`", "combine weights bf16");
  }
  {
    Call c = CombineCall(BF16, S32, 4, 8, 2, 2, 3, 1);
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`out", "combine out s32");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.rets[0].dims = {4, 9};
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`out", "combine out [4, 9]");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.attrs[0].value = -3;
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "`start`", "combine start -3");
  }
  {
    Call c = CombineCall(BF16, F32, 4, 8, 2, 2, 3, 1);
    c.attrs.push_back({"top_k", 2});
    ExpectInvalid(c.Run(MoeJaxCombineCuda), "attributes", "combine extra attribute");
  }
}

#define CUDA_CHECK(expr)                                                   \
  do {                                                                     \
    cudaError_t err_ = (expr);                                             \
    if (err_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__,   \
                   #expr, cudaGetErrorString(err_));                       \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

template <typename T>
void* ToDevice(const std::vector<T>& v) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, v.size() * sizeof(T) + 16));
  if (!v.empty()) {
    CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return p;
}

template <typename T>
std::vector<T> FromDevice(void* p, size_t n) {
  std::vector<T> v(n);
  CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Runs `call` on g_stream, or records it into a CUDA graph (as XLA's command
// buffers do) and replays that.
XLA_FFI_Error* RunMaybeCaptured(Call& call, XLA_FFI_Handler* handler, bool capture) {
  if (!capture) return call.Run(handler);
  CUDA_CHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
  XLA_FFI_Error* err = call.Run(handler);
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(g_stream, &graph));
  if (err != nullptr) return err;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, g_stream));
  CUDA_CHECK(cudaStreamSynchronize(g_stream));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return nullptr;
}

// T=3 tokens, k=2, P=2 ranks with one expert each, H=4 f32.
// Slot experts: n0->1 n1->0 n2->0 n3->1 n4->1 n5->0.
// sorted_slots = [1, 2, 5, 0, 3, 4]; offsets [0, 3]; counts [3, 3].
void TestEndToEnd(bool capture) {
  const int64_t T = 3, k = 2, P = 2, H = 4;
  std::vector<float> x(T * H);
  for (int64_t i = 0; i < T * H; ++i) x[i] = static_cast<float>(i + 1);
  const std::vector<int32_t> slots = {1, 2, 5, 0, 3, 4}, offsets = {0, 3}, counts = {3, 3};
  void* dx = ToDevice(x);
  void* dslots = ToDevice(slots);
  void* doff = ToDevice(offsets);
  void* dcnt = ToDevice(counts);
  const int64_t cap = 2, spill = 2, start = 0;
  void* dcap = ToDevice(std::vector<float>(P * cap * H, -7.0f));
  void* dspill = ToDevice(std::vector<float>(P * spill * H, -7.0f));
  Call pack = PackCall(XLA_FFI_DataType_F32, T, H, k, P, cap, spill);
  pack.args[0].data = dx;
  pack.args[1].data = dslots;
  pack.args[2].data = doff;
  pack.args[3].data = dcnt;
  pack.rets[0].data = dcap;
  pack.rets[1].data = dspill;
  pack.attrs[1].value = start;
  XLA_FFI_Error* err = RunMaybeCaptured(pack, MoeJaxPackCuda, capture);
  if (err) std::fprintf(stderr, "pack: %s\n", err->message.c_str());
  CHECK(err == nullptr);
  CUDA_CHECK(cudaStreamSynchronize(g_stream));
  // Rank 0 stream: slots 1,2,5 -> tokens 0,1,2; rank 1: slots 0,3,4 -> 0,1,2.
  const auto cap_rows = FromDevice<float>(dcap, P * cap * H);
  const auto spill_rows = FromDevice<float>(dspill, P * spill * H);
  const int want_cap_tokens[] = {0, 1, 0, 1};   // [p][c]
  const int want_spill_tokens[] = {2, -1, 2, -1};  // -1: zero row
  for (int r = 0; r < 4; ++r) {
    for (int h = 0; h < H; ++h) {
      CHECK(cap_rows[r * H + h] == x[want_cap_tokens[r] * H + h]);
      const float s = want_spill_tokens[r] < 0 ? 0.0f : x[want_spill_tokens[r] * H + h];
      CHECK(spill_rows[r * H + h] == s);
    }
  }
  ++g_passed;

  // Combine the packed rows back (identity experts) with weights 0.25/0.75,
  // into bf16; values are small integers so every step is exact.
  const std::vector<int32_t> dest = {1, 0, 0, 1, 1, 0}, pos = {0, 0, 1, 1, 2, 2};
  const std::vector<float> w = {0.25f, 0.75f, 0.25f, 0.75f, 0.25f, 0.75f};
  void* ddest = ToDevice(dest);
  void* dpos = ToDevice(pos);
  void* dw = ToDevice(w);
  void* dout = ToDevice(std::vector<uint16_t>(T * H, 0xFFFF));
  Call comb = CombineCall(XLA_FFI_DataType_F32, XLA_FFI_DataType_BF16, T, H, k, P, cap, spill);
  comb.args[0].data = dcap;
  comb.args[1].data = dspill;
  comb.args[2].data = ddest;
  comb.args[3].data = dpos;
  comb.args[4].data = dw;
  comb.rets[0].data = dout;
  err = RunMaybeCaptured(comb, MoeJaxCombineCuda, capture);
  if (err) std::fprintf(stderr, "combine: %s\n", err->message.c_str());
  CHECK(err == nullptr);
  CUDA_CHECK(cudaStreamSynchronize(g_stream));
  const auto out = FromDevice<uint16_t>(dout, T * H);
  for (int64_t i = 0; i < T * H; ++i) {
    uint32_t bits = static_cast<uint32_t>(out[i]) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    CHECK(v == x[i]);  // 0.25 x + 0.75 x, exact
  }
  ++g_passed;
  for (void* p : {dx, dslots, doff, dcnt, dcap, dspill, ddest, dpos, dw, dout}) {
    CUDA_CHECK(cudaFree(p));
  }
}

}  // namespace

int main() {
  TestTraits(MoeJaxPackCuda, "moe_jax_pack");
  TestTraits(MoeJaxCombineCuda, "moe_jax_combine");
  TestValidation();
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("handlers_cuda_test: no CUDA GPU (%s), end-to-end cases skipped\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
  } else {
    CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    // Captured first, so the kernels' lazy loading happens during capture.
    TestEndToEnd(/*capture=*/true);
    TestEndToEnd(/*capture=*/false);
    CUDA_CHECK(cudaStreamDestroy(g_stream));
  }
  std::printf("handlers_cuda_test: %d passed, 0 failed\n", g_passed);
  return 0;
}
