"""Recurrent generation of a Mamba (docs/design.md §1, "The recurrent step") against
transformers' own MambaForCausalLM.generate, greedy, in float64 (its float32 casts
removed as in test_mamba.py, by the same fixture): the same token ids from the same
parameters, through Python's generate and `ash generate`; documents in the prompt
reset the conv state and the scan state (`ash generate` on "doc1_doc2_doc3" gives
transformers' continuation of "doc3" alone, stopping after the separator).
"""
import subprocess

import pytest

import adjoint_sharding as ash

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_mamba import ash_config, float64_slow_path, hf_model, to_ash  # noqa: E402,F401

V = 256  # bytes are tokens


def lively(model, scale=10.0):
    """out_proj scaled: the mixers then outweigh each token's own embedding on the
    residual stream (a random model with a tied head otherwise repeats one token
    greedily, and a constant sample would compare little)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "out_proj" in name:
                p.mul_(scale)
    return model


def hf_greedy(model, prompt, n, use_cache):
    """transformers' greedy continuation of prompt (token ids): n new ids."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, use_cache=use_cache, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


# (K, D, N, expand, Kc, R, tied, seed): conv kernels 4 and 3 (> 2, so the conv state holds several tokens)
CASES = [(2, 8, 4, 2, 4, 2, True, 1), (3, 6, 3, 3, 3, 1, False, 0)]


@pytest.mark.parametrize("K,D,N,expand,Kc,R,tied,seed", CASES)
def test_greedy_matches_transformers(tmp_path, float64_slow_path, K, D, N, expand, Kc, R, tied, seed):  # noqa: F811
    model = lively(hf_model(V, D, N, K, expand, Kc, R, tied, 1e-5, seed=seed))
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), ash_config(V, D, N, K, expand, Kc, R, tied, 1e-5), "double")
    prompt, n = b"The selective scan", 24
    ours = [int(v) for v in ash.generate(path, list(prompt), n, temperature=0.0)]
    assert len(ours) == n and len(set(ours)) > 2, ours  # a sample that varies: the comparison says something
    # transformers' recurrent step (its cache: conv state and SSM state per layer) and
    # its full forward re-run at every step agree with each other and with ours
    assert hf_greedy(model, prompt, n, use_cache=True) == ours
    assert hf_greedy(model, prompt, n, use_cache=False) == ours


def run_generate(cli, *args):
    r = subprocess.run([cli, "generate", *map(str, args)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout


def test_cli_documents_reset_both_states(tmp_path, ash_cli, float64_slow_path):  # noqa: F811
    """A checkpoint trained with data.separator "_": the prompt's last document starts from
    a zero conv state and a zero SSM state, so `ash generate --temperature 0` continues it
    as transformers continues that document alone, and stops after the separator."""
    K, D, N, expand, Kc, R, tied = 2, 8, 4, 2, 4, 2, True
    model = lively(hf_model(V, D, N, K, expand, Kc, R, tied, 1e-5, seed=2))
    cfg = ash_config(V, D, N, K, expand, Kc, R, tied, 1e-5)
    cfg["data"] = {"separator": "_"}
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), cfg, "double")
    n = 30
    stops = 0
    for prompt, last in [(b"ab_cdefg_hi", b"hi"), (b"one_t", b"t")]:  # last documents shorter than Kc - 1
        out = run_generate(ash_cli, "--checkpoint", path, "--prompt", prompt.decode(), "--tokens", n,
                           "--temperature", 0)
        assert out.startswith(prompt) and out.endswith(b"\n")
        sample = list(out[len(prompt):-1])
        alone = hf_greedy(model, last, n, use_cache=True)
        ref = alone[:alone.index(ord("_")) + 1] if ord("_") in alone else alone  # one document: ends at "_"
        stops += len(ref) < n
        assert sample == ref, (prompt, bytes(sample), bytes(ref))
        # without the reset the prompt's earlier documents would change the continuation
        assert hf_greedy(model, prompt, n, use_cache=True) != alone
    assert stops > 0  # the stop at the separator was exercised
    # Python's generate samples all n tokens with no documents: transformers on the whole prompt
    ours = list(ash.generate(path, b"ab_cdefg_hi", n, temperature=0.0))  # bytes
    assert ours == hf_greedy(model, b"ab_cdefg_hi", n, use_cache=True)
