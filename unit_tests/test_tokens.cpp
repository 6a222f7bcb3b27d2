// Token files (bytes, .u16, .u32) and windows.
#include <fstream>

#include "test_helpers.hpp"

namespace ash::test {

namespace {
std::string write_file(const std::string& name, const std::string& bytes) {
  const auto p = tmp_path(name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}
}  // namespace

TEST(Tokens, ReadsBytesU16U32LittleEndian) {
  EXPECT_EQ(load_tokens(write_file("t.txt", "Hi!")), (std::vector<std::uint32_t>{72, 105, 33}));
  EXPECT_EQ(load_tokens(write_file("t.u16", std::string("\x01\x02\xff\x00", 4))),
            (std::vector<std::uint32_t>{0x0201, 0xff}));
  EXPECT_EQ(load_tokens(write_file("t.u32", std::string("\x01\x00\x01\x00", 4))),
            (std::vector<std::uint32_t>{0x10001}));
  EXPECT_THROW(load_tokens(write_file("odd.u16", "abc")), Error);
  EXPECT_THROW(load_tokens("/nonexistent/tokens.txt"), Error);
}

TEST(Tokens, WindowsAreConsecutive) {
  std::vector<std::uint32_t> ids(20);
  for (int i = 0; i < 20; ++i) ids[i] = i;
  auto x = make_windows(ids, 3, 5, 32, 2);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  for (int b = 0; b < 3; ++b)
    for (int t = 0; t < 5; ++t) EXPECT_EQ(h(b, t), 2 + b * 5 + t);
}

TEST(Tokens, BadWindowsAreErrors) {
  std::vector<std::uint32_t> ids(10, 3);
  EXPECT_THROW(make_windows(ids, 1, 0, 8), Error);   // T = 0
  EXPECT_THROW(make_windows(ids, 1, 1, 8), Error);   // no target
  EXPECT_THROW(make_windows(ids, 3, 4, 8), Error);   // needs 12 tokens
  EXPECT_THROW(make_windows(ids, 1, 4, 3), Error);   // id 3 >= V = 3
  EXPECT_NO_THROW(make_windows(ids, 2, 5, 4));
}

}  // namespace ash::test
