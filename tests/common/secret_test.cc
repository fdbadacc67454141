// SHA-256 and HMAC-SHA256 against the published test vectors (FIPS 180-4 examples, RFC 4231),
// and the per-user secret file's rules.
#include "common/secret.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

namespace conveyor::secret {
namespace {

std::string hex_of(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += std::string{digits[c >> 4], digits[c & 15]};
  return out;
}

TEST(Secret, Sha256MatchesFips180Examples) {
  EXPECT_EQ(hex_of(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex_of(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex_of(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex_of(sha256(std::string(1000000, 'a'))), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Secret, HmacMatchesRfc4231) {
  EXPECT_EQ(hmac_hex(std::string(20, '\x0b'), "Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hmac_hex("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hmac_hex(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(Secret, SameAndRandom) {
  EXPECT_TRUE(same("abc", "abc"));
  EXPECT_FALSE(same("abc", "abd"));
  EXPECT_FALSE(same("abc", "abcd"));
  const std::string a = random_hex(16), b = random_hex(16);
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
}

TEST(Secret, PerUserFileIsMadeOnceAndMustBePrivate) {
  const auto dir = std::filesystem::temp_directory_path() / ("conveyor-secret-" + random_hex(4));
  setenv("CONVEYOR_CACHE_DIR", dir.c_str(), 1);
  unsetenv("CONVEYOR_JOB_SECRET");
  auto first = job_secret();
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  EXPECT_EQ(first->size(), 64u);
  EXPECT_EQ(*job_secret(), *first);
  struct stat st {};
  ASSERT_EQ(stat((dir / "job-secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  chmod((dir / "job-secret").c_str(), 0644);
  auto exposed = job_secret();
  ASSERT_FALSE(exposed.is_ok());
  EXPECT_NE(exposed.status().message().find("readable by other users"), std::string::npos);
  setenv("CONVEYOR_JOB_SECRET", "given-by-the-launcher", 1);
  EXPECT_EQ(*job_secret(), "given-by-the-launcher");
  unsetenv("CONVEYOR_JOB_SECRET");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace conveyor::secret
