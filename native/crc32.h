// CRC-32 with the zlib polynomial (reflected 0xEDB88320), so that
// moestream::crc32(data, n, v) == zlib.crc32(data, v) for every input.
//
// The store's manifest records one CRC per expert block (computed by Python's zlib
// at convert time); the read engine verifies reads against it. On AArch64 with the
// CRC extension (every Apple Silicon chip) the ARMv8 CRC32X instructions compute this
// exact polynomial; elsewhere a slice-by-8 table walk is used.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moestream {

// Continue a CRC-32 over `n` bytes at `data`, starting from `crc` (0 for a new one),
// exactly like zlib's crc32(crc, data, n). Thread-safe, no allocation.
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0) noexcept;

// Which implementation crc32() uses on this build: "armv8-crc32" or "slice-by-8".
const char* crc32_implementation() noexcept;

}  // namespace moestream
