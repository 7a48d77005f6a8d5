// The kvpipe executable: everything lives in the launch library.
#include "launch/cli.h"

int main(int argc, char** argv) { return kvpipe::run_cli(argc, argv); }
