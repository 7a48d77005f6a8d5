// Fuzzes the job YAML: parsing, the validator `kvpipe validate` runs, and the checks that need
// the rank count. Lines "#set key=value" (YAML comments) are also applied as --set overrides,
// so the corpus reaches that parser too.
#include "launch/job_config.h"
#include "tests/fuzz/fuzz_support.h"

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpipe;
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("#set ", 0) == 0) overrides.push_back(line.substr(5));
  fuzz::accepts([&] {
    const JobConfig job = parse_job_config(text, "fuzz.yaml", overrides);
    (void)check_job_for_ranks(job, 3);
  });
  fuzz::accepts([&] { (void)validate_job_config_text(text, "fuzz.yaml", overrides, 2); });
  return 0;
}
