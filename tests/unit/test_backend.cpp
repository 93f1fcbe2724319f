// The backend table: dispatch by device and dtype, the errors a caller gets, and hand-worked
// cases of the CPU kernels added with the table (block copies, token shifts, loss sums, the
// routing-bias update, casts, seeded normal fill).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "core/philox.h"

namespace dstrain {
namespace {

Tensor f32(std::vector<float>& v, Shape s) { return Tensor(v.data(), DType::F32, s); }
Tensor i32(std::vector<int32_t>& v, Shape s) { return Tensor(v.data(), DType::I32, s); }

TEST(Backend, CpuIsRegisteredFirstWithEveryFp32Kernel) {
  const auto all = registered_backends();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.front()->name, "cpu");
  EXPECT_EQ(find_backend(DeviceType::CPU), all.front());
  EXPECT_GE(op_names().size(), 40u);
  for (const std::string& op : op_names()) EXPECT_TRUE(has_kernel(all.front()->ops, op, KernelDType::F32)) << op;
  EXPECT_FALSE(has_kernel(all.front()->ops, "no_such_op", KernelDType::F32));
  // Every op has 16-bit kernels on the CPU: fused ones or the generic widening ones.
  for (const std::string& op : op_names()) {
    EXPECT_TRUE(has_kernel(all.front()->ops, op, KernelDType::BF16)) << op;
    EXPECT_TRUE(has_kernel(all.front()->ops, op, KernelDType::F16)) << op;
  }
}

TEST(Backend, DispatchRefusesMixedDevicesAndMissingKernels) {
  std::vector<float> a(4, 1.0f), b(4, 2.0f);
  Tensor on_cuda(b.data(), DType::F32, Shape{4}, Device::cuda(0));
  try {
    ops::add_inplace(f32(a, {4}), on_cuda);
    FAIL() << "mixed devices accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add_inplace: tensors on cpu and cuda:0"), std::string::npos) << e.what();
  }
  // All on a device no backend is registered for.
  try {
    ops::fill(on_cuda, 0.0f);
    FAIL() << "unregistered device accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no backend is registered"), std::string::npos) << e.what();
  }
  // A bf16 tensor selects the bf16 slot: a backend without a bf16 kernel for the op says so.
  auto partial = std::make_unique<Backend>();
  partial->name = "partial";
  partial->device = DeviceType::CUDA;
  cpu::fill_table(partial->ops);
  partial->ops.fill[size_t(KernelDType::BF16)] = nullptr;
  register_backend(std::move(partial));
  std::vector<uint16_t> h(4);
  try {
    ops::fill(Tensor(h.data(), DType::BF16, Shape{4}, Device::cuda(0)), 1.0f);
    ADD_FAILURE() << "missing bf16 kernel not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fill: the partial backend has no bf16 kernel"), std::string::npos)
        << e.what();
  }
  unregister_backend(DeviceType::CUDA);
}

TEST(Backend, SixteenBitTensorsPickTheirSlotAndMayMixWithFp32Only) {
  // out fp32 = x bf16 . w bf16^T: the bf16 slot, accumulated in fp32.
  std::vector<float> xf = {1.5f, -2.0f, 0.25f, 3.0f, 1.0f, -1.0f}, wf = {0.5f, 1.0f, -1.0f, 2.0f, 0.0f, 4.0f};
  std::vector<uint16_t> xb(6), wb(6), ob(4);
  for (size_t i = 0; i < 6; ++i) {
    xb[i] = f32_to_bf16(xf[i]);
    wb[i] = f32_to_bf16(wf[i]);
  }
  std::vector<float> out(4, 100.0f);
  ops::linear_forward(f32(out, {2, 2}), Tensor(xb.data(), DType::BF16, Shape{2, 3}),
                      Tensor(wb.data(), DType::BF16, Shape{2, 3}), /*accumulate=*/true);
  // Every value is exact in bf16, so the products and sums are exact in fp32.
  EXPECT_EQ(out, (std::vector<float>{98.5f, 104.0f, 103.5f, 102.0f}));
  // The same product rounded into a bf16 output.
  ops::linear_forward(Tensor(ob.data(), DType::BF16, Shape{2, 2}), Tensor(xb.data(), DType::BF16, Shape{2, 3}),
                      Tensor(wb.data(), DType::BF16, Shape{2, 3}));
  EXPECT_EQ(bf16_to_f32(ob[0]), -1.5f);
  EXPECT_EQ(bf16_to_f32(ob[3]), 2.0f);
  // bf16 with f16 in one op is refused.
  std::vector<uint16_t> half(6);
  try {
    ops::add(Tensor(ob.data(), DType::BF16, Shape{4}), Tensor(half.data(), DType::F16, Shape{4}),
             Tensor(ob.data(), DType::BF16, Shape{4}));
    ADD_FAILURE() << "bf16 mixed with f16 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add: tensors of both bf16 and f16"), std::string::npos) << e.what();
  }
}

TEST(Backend, GenericSixteenBitKernelsKeepAliasingAndRoundOnce) {
  // cross_entropy_backward may write dlogits over logits: both arguments are one bf16 tensor.
  std::vector<float> logits_f = {1.0f, 2.0f, 0.5f, -1.0f, 0.0f, 3.0f};
  std::vector<uint16_t> lb(6);
  for (size_t i = 0; i < 6; ++i) lb[i] = f32_to_bf16(logits_f[i]);
  std::vector<int32_t> tg = {1, 2};
  std::vector<float> losses(2), lse(2);
  Tensor logits(lb.data(), DType::BF16, Shape{2, 3});
  ops::cross_entropy_forward(f32(losses, {2}), f32(lse, {2}), logits, i32(tg, {2}));
  std::vector<float> ref_logits = logits_f, ref_losses(2), ref_lse(2);
  ops::cross_entropy_forward(f32(ref_losses, {2}), f32(ref_lse, {2}), f32(ref_logits, {2, 3}), i32(tg, {2}));
  EXPECT_EQ(losses, ref_losses);  // every logit is exact in bf16
  ops::cross_entropy_backward(logits, logits, f32(lse, {2}), i32(tg, {2}), 0.5f);
  ops::cross_entropy_backward(f32(ref_logits, {2, 3}), f32(ref_logits, {2, 3}), f32(ref_lse, {2}), i32(tg, {2}), 0.5f);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(lb[i], f32_to_bf16(ref_logits[i])) << i;  // rounded once
  // An fp32 input with a bf16 output: RMSNorm writes its output rounded, its rstd in fp32.
  std::vector<float> x = {0.3f, -1.7f, 2.2f, 0.9f}, w = {1.0f, 0.5f, 2.0f, -1.0f}, rstd(1), ref_out(4), ref_rstd(1);
  std::vector<uint16_t> ob(4);
  ops::rmsnorm_forward(Tensor(ob.data(), DType::BF16, Shape{1, 4}), f32(rstd, {1}), f32(x, {1, 4}), f32(w, {4}),
                       1e-6f);
  ops::rmsnorm_forward(f32(ref_out, {1, 4}), f32(ref_rstd, {1}), f32(x, {1, 4}), f32(w, {4}), 1e-6f);
  EXPECT_EQ(rstd, ref_rstd);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(ob[i], f32_to_bf16(ref_out[i])) << i;
}

TEST(Backend, RegistrationIsByDeviceTypeAndChecked) {
  auto incomplete = std::make_unique<Backend>();
  incomplete->name = "incomplete";
  incomplete->device = DeviceType::CUDA;
  EXPECT_THROW(register_backend(std::move(incomplete)), Error);  // no fp32 kernels
  EXPECT_EQ(find_backend(DeviceType::CUDA), nullptr);
  auto again = std::make_unique<Backend>();
  again->name = "second cpu";
  again->device = DeviceType::CPU;
  cpu::fill_table(again->ops);
  EXPECT_THROW(register_backend(std::move(again)), Error);  // the CPU slot is taken
  EXPECT_THROW(unregister_backend(DeviceType::CPU), Error);
}

TEST(Kernels, CopyBlocksGathersBroadcastsAndSums) {
  // dst (2, 6) <- src (2, 4): blocks of width 2 from src columns 0 and 2 into dst 1 and 4.
  std::vector<float> src = {1, 2, 3, 4, 5, 6, 7, 8}, dst(12, 0.0f);
  ops::copy_blocks(f32(dst, {2, 6}), 1, 3, f32(src, {2, 4}), 0, 2, 2, 2, false);
  EXPECT_EQ(dst, (std::vector<float>{0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 8}));
  // Broadcast one block (src step 0) into two, then sum both back (dst step 0, accumulate).
  std::vector<float> one = {1, 2, 3, 4}, wide(8, 0.0f), back(4, 10.0f);
  ops::copy_blocks(f32(wide, {2, 4}), 0, 2, f32(one, {2, 2}), 0, 0, 2, 2, false);
  EXPECT_EQ(wide, (std::vector<float>{1, 2, 1, 2, 3, 4, 3, 4}));
  ops::copy_blocks(f32(back, {2, 2}), 0, 0, f32(wide, {2, 4}), 0, 2, 2, 2, true);
  EXPECT_EQ(back, (std::vector<float>{12, 14, 16, 18}));
  EXPECT_THROW(ops::copy_blocks(f32(dst, {2, 6}), 5, 0, f32(src, {2, 4}), 0, 0, 1, 2, false), Error);  // past a row
  EXPECT_THROW(ops::copy_blocks(f32(dst, {3, 4}), 0, 0, f32(src, {2, 4}), 0, 0, 1, 2, false), Error);  // rows differ
}

TEST(Kernels, ShiftTokensForMultiTokenPrediction) {
  const int32_t ig = ops::kIgnoreIndex;
  std::vector<int32_t> tg = {5, 6, ig, 8, 1, 2, 3, 4}, in(8), out(8);
  // Depth-1 inputs: the next targets, ignored ones read as token 0, 0 past the end.
  ops::shift_tokens(i32(in, {2, 4}), i32(tg, {2, 4}), 1, 0, 0);
  EXPECT_EQ(in, (std::vector<int32_t>{6, 0, 8, 0, 2, 3, 4, 0}));
  // Depth-1 targets: two ahead, ignored past the end.
  ops::shift_tokens(i32(out, {2, 4}), i32(tg, {2, 4}), 2, ig, ig);
  EXPECT_EQ(out, (std::vector<int32_t>{ig, 8, ig, ig, 3, 4, ig, ig}));
}

TEST(Kernels, LossSumsSkipIgnoredTargetsAndAccumulate) {
  std::vector<float> losses = {1.5f, 2.0f, 4.0f, 0.25f};
  std::vector<int32_t> targets = {3, ops::kIgnoreIndex, 0, 7};
  double out[2] = {1.0, 1.0};
  ops::loss_sums(Tensor(out, DType::F64, Shape{2}), f32(losses, {4}), i32(targets, {4}));
  EXPECT_EQ(out[0], 1.0 + 1.5 + 4.0 + 0.25);
  EXPECT_EQ(out[1], 1.0 + 3);
}

TEST(Kernels, RoutingBiasMovesTowardsBalance) {
  std::vector<float> bias = {0.5f, 0.5f, 0.5f, 0.5f};
  std::vector<int64_t> counts = {1, 3, 2, 2};  // mean 2
  ops::moe_bias_update(f32(bias, {4}), Tensor(counts.data(), DType::I64, Shape{4}), 0.25f);
  EXPECT_EQ(bias, (std::vector<float>{0.75f, 0.25f, 0.5f, 0.5f}));
}

TEST(Kernels, CastRoundTripsThroughHalfPrecision) {
  std::vector<float> x = {1.0f, -2.5f, 3.14159265f, 1e-3f, 65504.0f, INFINITY, NAN, 1.00390625f /* bf16 tie */};
  std::vector<uint16_t> h(x.size());
  std::vector<float> y(x.size());
  for (DType half : {DType::BF16, DType::F16}) {
    ops::cast(Tensor(h.data(), half, Shape{int64_t(x.size())}), f32(x, {int64_t(x.size())}));
    ops::cast(f32(y, {int64_t(y.size())}), Tensor(h.data(), half, Shape{int64_t(x.size())}));
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t expect = half == DType::BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
      EXPECT_EQ(h[i], expect) << dtype_name(half) << " element " << i;
      const float back = half == DType::BF16 ? bf16_to_f32(expect) : f16_to_f32(expect);
      if (std::isnan(x[i])) {
        EXPECT_TRUE(std::isnan(y[i]));
      } else {
        EXPECT_EQ(y[i], back) << dtype_name(half) << " element " << i;
      }
    }
  }
  EXPECT_EQ(h.size(), x.size());
  std::vector<int32_t> ints(8);
  EXPECT_THROW(ops::cast(i32(ints, {8}), f32(x, {8})), Error);
}

TEST(Kernels, FillNormalIsThePhiloxStream) {
  std::vector<float> a(1000), b(10);
  ops::fill_normal(f32(a, {1000}), 0.02, 7, 3, 0);
  ops::fill_normal(f32(b, {10}), 0.02, 7, 3, 500);  // a later piece of the same stream
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(a[size_t(i)], float(0.02 * philox_normal(7, 3, uint64_t(i))));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(b[size_t(i)], a[size_t(500 + i)]);
}

}  // namespace
}  // namespace dstrain
