#include "cohort/comm/address.h"

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::comm {
namespace {

using cohort::testing::expect_error;

TEST(Address, HostPortSplitsAtTheLastColonAndChecksThePort) {
  auto a = parse_host_port("10.0.0.1:29500");
  EXPECT_EQ(a.host, "10.0.0.1");
  EXPECT_EQ(a.port, 29500);
  EXPECT_EQ(parse_host_port("node-7.cluster:0").port, 0);  // 0: any free port
  EXPECT_EQ(parse_host_port("a:b:65535").host, "a:b");
  expect_error<UsageError>(
      [] { parse_host_port("nohost", "--master"); },
      "--master 'nohost' must be HOST:PORT: give HOST:PORT, e.g. 10.0.0.1:29500");
  expect_error<UsageError>([] { parse_host_port(":29500"); }, "address ':29500' names no host");
  for (const std::string bad : {"h:", "h:x1", "h:-1", "h: 80", "h:123456", "h:80x"}) {
    expect_error<UsageError>([&] { parse_host_port(bad); }, "has no port number");
  }
  expect_error<UsageError>([] { parse_host_port("h:70000", "coordinator address"); },
                           "coordinator address 'h:70000' has port 70000, out of range (0..65535)");
}

}  // namespace
}  // namespace cohort::comm
