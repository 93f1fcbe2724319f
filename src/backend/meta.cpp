#include "backend/meta.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>

#include "backend/backend.h"
#include "core/allocator.h"
#include "core/error.h"

namespace dstrain::meta {
namespace {

// Address space without access rights and without backing (PROT_NONE, MAP_NORESERVE): distinct
// pointers for distinct buffers, no memory used, and a fault at the first touch.
class MetaAllocator final : public Allocator {
 public:
  std::string_view name() const override { return "meta"; }
  DeviceType device() const override { return DeviceType::Meta; }
  void* allocate(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.type == DeviceType::Meta, "the meta allocator got a request for {}", device.str());
    if (bytes == 0) return nullptr;
    void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw OutOfMemory(fmt::format("meta device: reserving {} bytes of address space for '{}' failed: {}", bytes,
                                    label, std::strerror(errno)));
    }
    return p;
  }
  void free(Device, void* p, size_t bytes) override {
    if (p) ::munmap(p, bytes);
  }
  void zero(Device, void*, size_t) override {}
  void release_pages(Device, void*, size_t) override {}
};

// Every op of ops.def, in every kernel slot, does nothing.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
void fill_table(OpTable& t) {
  using namespace ops;
#define DS_OP(name, params, args) t.name.fill([] params {});
#include "backend/ops.def"
#undef DS_OP
}
#pragma GCC diagnostic pop

}  // namespace

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_allocator(std::make_unique<MetaAllocator>());
    auto b = std::make_unique<Backend>();
    b->name = "meta";
    b->device = DeviceType::Meta;
    fill_table(b->ops);
    register_backend(std::move(b));
  });
}

}  // namespace dstrain::meta
