"""compare.py BEFORE AFTER: snapshot.sh's two folders bit for bit (gradient files, eval loss, plan
text, metrics, trained parameters); prints every difference and their count, exit 1 on any."""
import sys, os, glob, h5py, numpy as np
a, b = sys.argv[1], sys.argv[2]
bad = 0
for f in sorted(glob.glob(a + "/*.grad")):
    g = b + "/" + os.path.basename(f)
    if not os.path.exists(g): print("MISSING", g); bad += 1; continue
    A, B = h5py.File(f), h5py.File(g)
    na, nb = [], []
    A.visititems(lambda n, o: na.append(n) if isinstance(o, h5py.Dataset) else None)
    B.visititems(lambda n, o: nb.append(n) if isinstance(o, h5py.Dataset) else None)
    if sorted(na) != sorted(nb): print("NAMES differ", f); bad += 1; continue
    for n in na:
        if n.startswith("meta") or "time" in n: continue
        x, y = A[n][()], B[n][()]
        if isinstance(x, np.ndarray):
            if x.tobytes() != y.tobytes(): print("DIFF", os.path.basename(f), n, np.max(np.abs(x - y))); bad += 1
        elif x != y and not isinstance(x, (bytes, str)): print("DIFF", os.path.basename(f), n, x, y); bad += 1
for f in sorted(glob.glob(a + "/*.txt")) + sorted(glob.glob(a + "/*.loss")):
    g = b + "/" + os.path.basename(f)
    if not os.path.exists(g): print("MISSING", g); bad += 1; continue
    if open(f).read() != open(g).read(): print("TEXT DIFF", os.path.basename(f)); bad += 1
print("compared", len(glob.glob(a + "/*.grad")), "gradient files;", bad, "differences")
for arch in ("ssm", "mamba"):
    fa, fb = f"{a}/{arch}.eval.full", f"{b}/{arch}.eval.full"
    la = [l for l in open(fa) if l.startswith("loss")]; lb = [l for l in open(fb) if l.startswith("loss")]
    if la != lb: print("EVAL DIFF", arch, la, lb); bad += 1
    ca, cb = h5py.File(f"{a}/run_{arch}/checkpoint.h5"), h5py.File(f"{b}/run_{arch}/checkpoint.h5")
    names = []
    ca["/params"].visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    for n in names:
        if ca["/params/" + n][()].tobytes() != cb["/params/" + n][()].tobytes(): print("TRAINED PARAMS DIFF", arch, n); bad += 1
print("with eval and trained checkpoints:", bad, "differences")
sys.exit(1 if bad else 0)
