// gradmesh: the command-line client of gradmesh_coordinator (see cli/cli.h for the commands).
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "cli/cli.h"

int main(int argc, char** argv) {
  gradmesh::cli::CliOptions options;
  for (const char* name : {"GRADMESH_COORDINATOR", "GRADMESH_AUTH_TOKEN_FILE"}) {
    if (const char* v = std::getenv(name)) options.env[name] = v;
  }
  gradmesh::cli::CliIo io;
  io.out = &std::cout;
  io.err = &std::cerr;
  io.out_is_terminal = isatty(STDOUT_FILENO) == 1;
  return gradmesh::cli::RunCli(std::vector<std::string>(argv + 1, argv + argc), options, io);
}
