#include "worker/modes.h"

#include <utility>

#include "worker/allreduce/allreduce_mode.h"
#include "worker/gossip/gossip_mode.h"

namespace gradmesh {

TrainingModeRegistry BuiltinTrainingModes(ParameterClientFactory ps_client, PeerServices peers) {
  TrainingModeRegistry modes("training mode");
  TrainingModeFactory ps = [ps_client = std::move(ps_client)](const TrainerOptions& options) {
    return NewPsMode(options, ps_client);
  };
  for (Mode m : {Mode::kAsync, Mode::kSsp, Mode::kSync, Mode::kDiloco}) {
    modes.Set(std::string(ModeName(m)), ps);
  }
  modes.Set(std::string(ModeName(Mode::kGossip)), [peers](const TrainerOptions& options) {
    return NewGossipMode(options, peers.gossip);
  });
  modes.Set(std::string(ModeName(Mode::kAllreduce)), [peers](const TrainerOptions& options) {
    return NewAllreduceMode(options, peers.collective);
  });
  return modes;
}

}  // namespace gradmesh
