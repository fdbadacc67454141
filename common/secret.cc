#include "common/secret.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>

#include "common/env.h"
#include "common/file.h"

namespace conveyor::secret {
namespace {

constexpr std::array<std::uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress(std::array<std::uint32_t, 8>& h, const unsigned char* block) {
  std::uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (std::uint32_t{block[4 * i]} << 24) | (std::uint32_t{block[4 * i + 1]} << 16) |
           (std::uint32_t{block[4 * i + 2]} << 8) | std::uint32_t{block[4 * i + 3]};
  }
  for (int i = 16; i < 64; ++i) {
    const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  std::uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; ++i) {
    const std::uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    const std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

}  // namespace

std::string sha256(std::string_view data) {
  std::array<std::uint32_t, 8> h = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::size_t i = 0;
  for (; i + 64 <= data.size(); i += 64) compress(h, reinterpret_cast<const unsigned char*>(data.data() + i));
  unsigned char tail[128] = {};
  const std::size_t left = data.size() - i;
  std::memcpy(tail, data.data() + i, left);
  tail[left] = 0x80;
  const std::size_t blocks = left + 9 > 64 ? 2 : 1;
  const std::uint64_t bits = static_cast<std::uint64_t>(data.size()) * 8;
  for (int b = 0; b < 8; ++b) tail[blocks * 64 - 1 - b] = static_cast<unsigned char>(bits >> (8 * b));
  for (std::size_t b = 0; b < blocks; ++b) compress(h, tail + 64 * b);
  std::string out(32, '\0');
  for (int k = 0; k < 8; ++k) {
    for (int b = 0; b < 4; ++b) out[4 * k + b] = static_cast<char>(h[k] >> (24 - 8 * b));
  }
  return out;
}

std::string hmac_hex(std::string_view key, std::string_view message) {
  std::string k = key.size() > 64 ? sha256(key) : std::string(key);
  k.resize(64, '\0');
  std::string inner(64, '\0'), outer(64, '\0');
  for (int i = 0; i < 64; ++i) {
    inner[i] = static_cast<char>(k[i] ^ 0x36);
    outer[i] = static_cast<char>(k[i] ^ 0x5c);
  }
  inner.append(message);
  outer += sha256(inner);
  return to_hex(sha256(outer));
}

std::string to_hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string from_hex(std::string_view text) {
  auto value = [](char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; };
  std::string out;
  for (std::size_t i = 0; i + 1 < text.size(); i += 2) out += static_cast<char>(value(text[i]) * 16 + value(text[i + 1]));
  return out;
}

bool same(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string random_hex(std::size_t bytes) {
  std::string raw(bytes, '\0');
  std::size_t got = 0;
  while (got < bytes) {
    const ssize_t n = getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    CONVEYOR_CHECK(n > 0, "getrandom failed");
    got += static_cast<std::size_t>(n);
  }
  return to_hex(raw);
}

Result<std::string> job_secret() {
  if (std::string s = env::job_secret(); !s.empty()) return s;
  namespace fs = std::filesystem;
  const fs::path dir = env::cache_dir();
  const fs::path path = dir / "job-secret";
  std::error_code ec;
  fs::create_directories(dir, ec);
  // Made once, exclusively, readable by this user only; a second process racing to make it
  // reads the winner's.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd >= 0) {
    const std::string made = random_hex(32);
    const bool written = ::write(fd, made.data(), made.size()) == static_cast<ssize_t>(made.size());
    ::close(fd);
    if (!written) return Status(ErrorCode::kIo, "cannot write the job secret file '" + path.string() + "'");
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    return Status(ErrorCode::kInvalidArgument, "the job secret file '" + path.string() +
                                                   "' is readable by other users; chmod 600 it (or set CONVEYOR_JOB_SECRET)");
  }
  for (int attempt = 0; attempt < 50; ++attempt) {
    auto text = read_file(path.string(), "job secret file", kConfigFileLimit);
    if (!text) return text.status();
    if (text->size() == 64) return *text;
    usleep(10000);  // another process is writing it
  }
  return Status(ErrorCode::kInvalidArgument, "the job secret file '" + path.string() +
                                                 "' does not hold a secret; delete it (it is made again) or set CONVEYOR_JOB_SECRET");
}

}  // namespace conveyor::secret
