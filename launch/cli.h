// The `kvpipe` command line: sub-commands, their flags, and the exit-code contract
// (0 success, 2 bad input with a one-line message, 1 internal failure).
#pragma once

namespace kvpipe {

int run_cli(int argc, char** argv);

}  // namespace kvpipe
