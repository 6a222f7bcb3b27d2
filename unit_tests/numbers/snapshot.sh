#!/usr/bin/env bash
# snapshot.sh ASH OUTDIR: gradients, eval, plan and a 20-step train of an SSM-ResNet and a Mamba in
# double (every engine and mode, the memory levers, np 2-4 layouts) into OUTDIR, for a change that
# must not change a number: run it with the build before and after, then compare.py BEFORE AFTER
# (every gradient file, eval loss, plan text and trained parameter bit for bit). Not part of ctest
# (about 2 minutes on 2 cores); docs/testing.md, "No number changes".
set -uo pipefail
ASH=$1; OUT=$2; mkdir -p "$OUT"; cd "$OUT"
MPI="timeout 300 mpiexec --oversubscribe --allow-run-as-root"
"${PYTHON:-python3}" -c "import random; random.seed(3); open('tok.u8','wb').write(bytes(random.randrange(40) for _ in range(20000)))"
for arch in ssm mamba; do
  if [ $arch = ssm ]; then A="--set model.vocab=40 --set model.width=12 --set model.state=4 --set model.layers=4"
  else A="--set model.arch=mamba --set model.vocab=40 --set model.width=8 --set model.state=3 --set model.layers=4 --set model.tie_embeddings=false --set model.dt_rank=2"; fi
  $ASH init --out $arch.h5 --precision double $A > /dev/null || echo "FAIL init $arch"
  D="--set data.seq_len=96 --set data.batch=3 --set grad.chunk=8"
  run() { name=$1; shift; "$@" > $arch.$name.log 2>&1 || echo "FAIL $arch $name"; }
  run e1 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine backprop --out $arch.e1.grad
  run e1d $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine backprop --detach-inputs --out $arch.e1d.grad
  run e2 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint --out $arch.e2.grad
  run e2t $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint --truncate 7 --out $arch.e2t.grad
  run e3 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --out $arch.e3.grad
  run e3d $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --detach-inputs --out $arch.e3d.grad
  run e3w $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --detach-inputs --truncate 7 --out $arch.e3w.grad
  run tb $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set grad.token_block=24 --out $arch.tb.grad
  run lc $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set grad.layer_checkpoint=2 --set grad.token_block=40 --out $arch.lc.grad
  run bf $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set run.storage=bf16 --set grad.token_block=32 --out $arch.bf.grad
  run tbd $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --detach-inputs --set grad.token_block=24 --out $arch.tbd.grad
  run r2 $MPI -n 2 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set dist.layer_ranks=2 --out $arch.r2.grad
  run r2tb $MPI -n 2 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set dist.layer_ranks=2 --set grad.token_block=24 --out $arch.r2tb.grad
  run s2 $MPI -n 2 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set dist.seq_ranks=2 --out $arch.s2.grad
  run s2tb $MPI -n 2 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set dist.seq_ranks=2 --set grad.token_block=16 --set grad.layer_checkpoint=2 --out $arch.s2tb.grad
  run s2w $MPI -n 2 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --detach-inputs --truncate 7 --set dist.seq_ranks=2 --out $arch.s2w.grad
  run r2s2 $MPI -n 4 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --engine adjoint-exact --set dist.seq_ranks=2 --set dist.layer_ranks=2 --out $arch.r2s2.grad
  run d2 $MPI -n 2 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --set data.batch=4 --engine backprop --set dist.data_ranks=2 --out $arch.d2.grad
  run d2e3 $MPI -n 4 $ASH grad --checkpoint $arch.h5 --tokens tok.u8 $D --set data.batch=4 --engine adjoint-exact --set dist.data_ranks=2 --set dist.layer_ranks=2 --out $arch.d2e3.grad
  $ASH eval --checkpoint $arch.h5 --tokens tok.u8 --set data.seq_len=96 --set data.batch=3 > $arch.eval.full 2>&1
  for lv in "" "--set grad.token_block=24" "--set run.storage=bf16 --set grad.layer_checkpoint=2" "--set dist.seq_ranks=2 --set grad.token_block=16"; do
    $ASH plan $A $D --set grad.engine=adjoint-exact $lv >> $arch.plan.txt 2>&1
  done
  mkdir -p run_$arch
  $ASH train $A --set data.train=$OUT/tok.u8 --set data.seq_len=48 --set data.batch=2 --set grad.engine=adjoint-exact --set grad.token_block=16 --set run.precision=double --set optim.steps=20 --set run.log_every=5 --set run.eval_every=10 --set run.out_dir=$OUT/run_$arch --set optim.warmup=2 > $arch.train.log 2>&1 || echo "FAIL $arch train"
  "${PYTHON:-python3}" - "$OUT/run_$arch/metrics.jsonl" > $arch.train.loss <<'PY'
import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l); print({k:v for k,v in d.items() if 'loss' in k or k=='step' or 'norm' in k})
PY
done
echo done
