// CRC-32 (zlib polynomial): ARMv8 CRC instructions where available, else slice-by-8.
#include "crc32.h"

#include <cstring>

#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define MOESTREAM_ARM_CRC32 1
#endif

namespace moestream {
namespace {

// Slice-by-8: table[k][b] is the CRC of byte b followed by k zero bytes, so eight
// input bytes fold into the running CRC with eight independent lookups per step.
struct Tables {
  uint32_t t[8][256];
};

constexpr Tables make_tables() {
  Tables tb{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    tb.t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int k = 1; k < 8; ++k)
      tb.t[k][i] = (tb.t[k - 1][i] >> 8) ^ tb.t[0][tb.t[k - 1][i] & 0xFFu];
  return tb;
}

constexpr Tables kTables = make_tables();

[[maybe_unused]] uint32_t crc32_bytewise(const unsigned char* p, size_t n, uint32_t c) noexcept {
  while (n--) c = kTables.t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
  return c;
}

#if !defined(MOESTREAM_ARM_CRC32)
uint32_t crc32_slice8(const unsigned char* p, size_t n, uint32_t c) noexcept {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  while (n && (reinterpret_cast<uintptr_t>(p) & 7u)) {
    c = kTables.t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    --n;
  }
  const auto& t = kTables.t;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    const uint32_t lo = static_cast<uint32_t>(v) ^ c;
    const uint32_t hi = static_cast<uint32_t>(v >> 32);
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
#endif
  return crc32_bytewise(p, n, c);
}
#endif

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(MOESTREAM_ARM_CRC32)
  while (n && (reinterpret_cast<uintptr_t>(p) & 7u)) {
    c = __crc32b(c, *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __crc32d(c, v);
    p += 8;
    n -= 8;
  }
  while (n--) c = __crc32b(c, *p++);
#else
  c = crc32_slice8(p, n, c);
#endif
  return ~c;
}

const char* crc32_implementation() noexcept {
#if defined(MOESTREAM_ARM_CRC32)
  return "armv8-crc32";
#else
  return "slice-by-8";
#endif
}

}  // namespace moestream
