// The planner (ash plan) on a Mamba against the measured Kokkos peak.
#include <sstream>

#include "test_helpers.hpp"

namespace ash::test {

// The planner's Mamba E1 and E3 (ash plan, check_memory) against the measured Kokkos peak, within 10 %
// (a FalconMamba's too: its norms' r is one more activation).
TEST(Mamba, PlanMatchesMeasuredPeak) {
  for (const std::string engine :
       {"grad.engine=backprop", "grad.engine=adjoint-exact", "grad.engine=adjoint",
        "grad.engine=adjoint grad.truncate=16", "grad.engine=backprop grad.detach_inputs=true",
        "grad.engine=adjoint-exact grad.detach_inputs=true",
        "grad.engine=adjoint-exact grad.detach_inputs=true grad.truncate=16",
        "grad.engine=adjoint-exact grad.token_block=128",
        "grad.engine=adjoint-exact grad.token_block=96 grad.layer_checkpoint=2 run.storage=bf16",
        "grad.engine=adjoint-exact grad.detach_inputs=true grad.token_block=64 "
        "grad.layer_checkpoint=3",
        "grad.engine=adjoint-exact data.sequential=true data.carry_state=true",
        "grad.engine=adjoint-exact grad.token_block=96 run.storage=bf16 "
        "data.sequential=true data.carry_state=true"})
    for (const char* T : {"data.seq_len=512", "data.seq_len=200", "data.seq_len=300 model.arch=falcon_mamba",
                        "data.seq_len=300 model.arch=mamba2 model.dt_rank=0 model.head_dim=8 model.n_groups=2"}) {
      Config c = config_for(mamba_tiny_dims(2, false, 4, 0));
      for (const std::string s : std::vector<std::string>{"model.vocab=64", "model.width=16", "model.state=8",
                                                          "data.batch=2", "grad.chunk=32", "grad.wave=64"})
        c.set(s);
      for (const std::string& keys : {std::string(T), engine}) {  // space-separated keys
        std::istringstream words(keys);
        for (std::string w; words >> w;) c.set(w);
      }
      const Settings st = c.settings();
      const std::string sp = MemSpace::name();
      const auto base = MemoryTracker::current(sp);
      MemoryTracker::reset_peak();
      {
        ParamSet<double> ps(st.model);
        initialize(ps, 1);
        ParamSet<double> g(st.model);
        const auto x = random_tokens(st.data.batch, st.data.seq_len, st.model.vocab, 5);
        auto engine = make_engine<double>(st.grad);
        std::vector<View2<double>> carried;  // data.carry_state: as ash train holds it
        for (index_t k = 0; st.grad.carry_state && k < st.model.layers; ++k)
          carried.emplace_back("carried", st.data.batch * st.model.carry_rows(), st.model.carry_cols());
        if (st.grad.carry_state) engine->set_carried_state(&carried);
        engine->compute(ps, x, g);
        Kokkos::fence();
      }
      const double measured = double(MemoryTracker::peak(sp) - base);
      const double planned = plan_memory(st, Workload::grad, 8).total();
      std::printf("  plan/measured %.3f (%s, %s)\n", planned / measured, engine.c_str(), T);
      EXPECT_LE(std::fabs(planned - measured), 0.10 * measured)
          << engine << ", " << T << ": planned " << planned << ", measured " << measured;
    }
}

}  // namespace ash::test
