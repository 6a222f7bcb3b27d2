"""adjoint_sharding: exact O(T)-memory adjoint gradients for residual SSM language models.

The Python face of the C++ library (docs/python.md). Functions here take a
checkpoint path and token arrays and return numpy arrays; the PyTorch module
of the K layers is adjoint_sharding.torch.SSMStack.

    import numpy as np, adjoint_sharding as ash
    loss, grads = ash.grad("model.h5", np.frombuffer(b"hello world" * 20, np.uint8), seq_len=64)
    grads["layers/000/W_delta"].shape   # (P, P)

Errors are adjoint_sharding.Error (a ValueError) with the `ash` tool's one-line messages.
"""
import json as _json

import numpy as _np

from . import _core
from ._core import Error

__all__ = ["Error", "grad", "load", "save", "init", "evaluate", "train", "generate", "plan", "default_config",
           "import_hf", "export_hf", "backend", "device"]

backend = _core.backend  # the Kokkos execution space the library was built for ("Serial", "OpenMP", ...)


def device():
    """Where this build runs and where the tensors it reads in place must be: "cpu", or
    "cuda:N" (the GPU Kokkos runs on) for a CUDA build (docs/python.md, "CUDA")."""
    return _core.device()


def _tokens(tokens, what="tokens"):
    """A 1-D integer (or bytes) array as contiguous uint32, checked."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        tokens = _np.frombuffer(tokens, dtype=_np.uint8)
    a = _np.asarray(tokens)
    if a.ndim != 1:
        raise Error(f"{what} must be a 1-D array of token ids, got {a.ndim} dimensions {tuple(a.shape)}")
    if a.dtype.kind not in "iu":
        raise Error(f"{what} must hold integers (int or uint8..uint64), got dtype {a.dtype}")
    if a.size and a.dtype.kind == "i" and int(a.min()) < 0:
        raise Error(f"{what} holds a negative id ({int(a.min())})")
    if a.size and int(a.max()) > 0xFFFFFFFF:
        raise Error(f"{what} holds an id >= 2^32 ({int(a.max())})")
    return _np.ascontiguousarray(a, dtype=_np.uint32)


def _precision(p):
    if p is None:
        return ""
    if p in ("float", "float32", _np.float32):
        return "float"
    if p in ("double", "float64", _np.float64):
        return "double"
    raise Error(f"precision must be None, 'float' or 'double', got {p!r}")


def _config_json(config):
    if isinstance(config, str):
        return config
    return _json.dumps(config)


def _integer(name, value, lo=-2**63, hi=2**63 - 1):
    """value as a Python int in [lo, hi] (the library's integer type), else Error naming it."""
    if isinstance(value, (bool, _np.bool_)) or not isinstance(value, (int, _np.integer)):
        raise Error(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise Error(f"{name} must be an integer from {lo} to {hi}, got {v}")
    return v


def _int_option(name, value):
    """None (the checkpoint's value) or a 64-bit integer named `name`."""
    return None if value is None else _integer(name, value)


def _windows(ids, seq_len, batch):
    """A 2-D (B, L) array of token ids as the flat tokens of B windows of L tokens, checked
    against seq_len and batch where they are given."""
    a = _np.asarray(ids)
    if a.ndim != 2:
        raise Error(f"ids must be a 2-D array (batch, seq_len) of token ids, got {a.ndim} dimension(s) "
                    f"{tuple(a.shape)}")
    B, L = (int(n) for n in a.shape)
    for name, given, shape in (("seq_len", seq_len, L), ("batch", batch, B)):
        if given is not None and int(given) != shape:
            raise Error(f"{name}={int(given)} does not match ids of shape {tuple(a.shape)} ({name} {shape})")
    return _tokens(a.reshape(-1), "ids"), L, B


def grad(checkpoint_path, tokens=None, *, ids=None, seq_len=None, batch=None, engine=None, truncate=None,
         detach_inputs=None, chunk=None, precision=None, storage=None, layer_checkpoint=None, token_block=None,
         set=(), state=None):
    """(loss, grads): what `ash grad` computes for the first `batch` windows of `seq_len` tokens.

    Every option left None keeps the checkpoint's stored value, as `ash grad` without the
    flag; one given replaces it (after `set`, a list of "key=value" like `ash grad --set`).
    engine (grad.engine), truncate (grad.truncate), detach_inputs (grad.detach_inputs),
    chunk (grad.chunk), seq_len (data.seq_len), batch (data.batch); storage ("float",
    "bf16", "fp16"; run.storage), layer_checkpoint (grad.layer_checkpoint) and token_block
    (grad.token_block) are the memory levers of docs/design.md §8.
    tokens: 1-D integer or uint8 array (or bytes), cut into windows as `ash grad` does.
    Or ids: a 2-D integer array (B, L), row b one window, with transformers' loss
    convention: row b predicts ids[b, 1:] from ids[b, :-1], the loss is the mean over all
    B·(L−1) targets (model(input_ids=ids, labels=ids).loss); seq_len and batch come from
    the shape (if given they must match it), and the checkpoint's data.separator is not
    applied (rows are whole sequences; set= may set it).
    grads: dict keyed by the gradient file's paths under /grad ("embedding", "final_norm",
    "head", "layers/000/W_delta" or a Mamba's "layers/000/in_proj", ...) with numpy arrays
    in the compute precision (precision=None: the checkpoint's).
    state: None, or the carried state of data.carry_state (docs/design.md §8), a C-contiguous
    array in the compute precision, [K, batch·P, N] (a Mamba: [K, batch·E, conv_kernel−1+N],
    each row the conv's last inputs, oldest first, then h): the windows start from it (a
    constant: no gradient flows into it) and it is overwritten with the state after them,
    the next windows' (engine adjoint-exact, one process).
    """
    o = _core.RunOverrides()
    o.sets = [str(s) for s in set]
    if ids is not None:
        if tokens is not None:
            raise Error("grad takes tokens (1-D) or ids (2-D, batch x seq_len), not both")
        flat, seq_len, batch = _windows(ids, seq_len, batch)
        o.rows_are_sequences = True  # transformers' convention: every row's targets count
    else:
        if tokens is None:
            raise Error("grad needs tokens (1-D) or ids (2-D, batch x seq_len)")
        flat = _tokens(tokens)
    o.engine = None if engine is None else str(engine)
    o.truncate = _int_option("truncate", truncate)
    o.detach_inputs = None if detach_inputs is None else bool(detach_inputs)
    o.chunk = _int_option("chunk", chunk)
    o.storage = None if storage is None else str(storage)
    o.layer_checkpoint = _int_option("layer_checkpoint", layer_checkpoint)
    o.token_block = _int_option("token_block", token_block)
    o.seq_len = _int_option("seq_len", seq_len)
    o.batch = _int_option("batch", batch)
    return _core.grad(str(checkpoint_path), flat, o, _precision(precision), state)


class Checkpoint(dict):
    """A loaded checkpoint: a dict name -> numpy array (the /params paths), plus
    .config (dict), .precision ("float" or "double") and .step."""

    def __init__(self, params, config, precision, step=0):
        super().__init__(params)
        self.config = config
        self.precision = precision
        self.step = step


def load(path):
    """Reads a checkpoint (docs/file_format.md): a Checkpoint (dict of numpy arrays)."""
    d = _core.load(str(path))
    return Checkpoint(d["params"], _json.loads(d["config"]), d["precision"], d["step"])


def save(path, params, config=None, precision=None, step=0):
    """Writes a checkpoint that `ash` reads. params: dict name -> array (every tensor of the
    model; a Checkpoint keeps its own config and precision unless given)."""
    if config is None:
        config = getattr(params, "config", None)
    if config is None:
        raise Error("save: no config (pass config=, or a Checkpoint from load())")
    step = _integer("step", step, 0)  # before any array is converted
    precision = _precision(precision or getattr(params, "precision", None)) or "float"
    dt = _np.float32 if precision == "float" else _np.float64
    arrays = {k: _np.ascontiguousarray(v, dtype=dt) for k, v in dict(params).items()}
    _core.save(str(path), _config_json(config), arrays, precision, step)


def default_config():
    """Every configuration key with its default (docs/design.md §4), as a dict."""
    return _json.loads(_core.default_config())


def init(config, precision="float"):
    """A fresh model as `ash init` makes it (seeded by model.seed): a Checkpoint, not written."""
    text = _config_json(config)  # JSON text is parsed by the library: a duplicate key is refused, as `ash init`'s
    full = _json.loads(_core.full_config(text))
    precision = _precision(precision) or "float"
    return Checkpoint(_core.init_params(text, precision), full, precision, 0)


def evaluate(checkpoint_path, tokens, *, seq_len=None, batch=None, precision=None):
    """Forward-only loss over consecutive windows of `tokens` (`ash eval`): a dict with
    loss (nats/token), bits_per_token and targets. seq_len and batch: None keeps the
    checkpoint's data.seq_len / data.batch, as grad."""
    o = _core.RunOverrides()
    o.seq_len = _int_option("seq_len", seq_len)
    o.batch = _int_option("batch", batch)
    nats, bits, n = _core.evaluate(str(checkpoint_path), _tokens(tokens), o, _precision(precision))
    return {"loss": nats, "bits_per_token": bits, "targets": n}


def train(config, progress=None, *, resume=None, until=0):
    """`ash train` with a configuration dict (or JSON text): progress(line) is called with each
    progress line the tool would print. Returns a summary dict (last_loss, val_bits,
    checkpoint, peak_bytes, ...)."""
    return _core.train(_config_json(config), progress, "" if resume is None else str(resume),
                       _integer("until", until, 0))


def generate(checkpoint_path, prompt, n, *, temperature=1.0, seed=0):
    """Samples n tokens after prompt (bytes, str or token ids), as `ash generate`: bytes for a byte
    vocabulary (V <= 256) when prompt is bytes or str, else a numpy array of ids."""
    as_text = isinstance(prompt, (str, bytes, bytearray))
    if isinstance(prompt, str):
        prompt = prompt.encode()
    n, seed = _integer("n", n), _integer("seed", seed, 0, 2**64 - 1)
    ids = _tokens(prompt, "prompt")
    out = _np.asarray(_core.generate(str(checkpoint_path), ids, n, float(temperature), seed), dtype=_np.uint32)
    if as_text and (out.size == 0 or int(out.max()) < 256):
        return bytes(out.astype(_np.uint8))
    return out


def plan(config, workload="train", precision=None):
    """The memory planner (`ash plan`): dict with items (bytes per component), total, capacity
    of this machine's memory space, engine, phase and the printed table."""
    return _core.plan(_config_json(config), str(workload), _precision(precision))


def import_hf(hf_dir, out, precision="double"):
    """`ash import-hf`: a Hugging Face MambaForCausalLM or FalconMambaForCausalLM folder (config.json
    and model.safetensors, or its index and shards) written as the checkpoint `out` in precision
    "float" or "double" (model.arch "mamba" or "falcon_mamba", with model.mixer_rms_eps).
    Returns a dict: config (the stored configuration), source_dtypes ("F32", ...), ignored
    (config.json keys transformers does not define) and parameters."""
    precision = _precision(precision) or "double"
    r = _core.import_hf(str(hf_dir), str(out), precision)
    r["config"] = _json.loads(r["config"])
    return r


def export_hf(checkpoint_path, hf_dir, dtype=None):
    """`ash export-hf`: a model.arch = "mamba" (or "falcon_mamba") checkpoint written as
    config.json and model.safetensors in `hf_dir` (created when missing), which
    transformers.MambaForCausalLM.from_pretrained(hf_dir) (FalconMambaForCausalLM's) loads. dtype: "float" (F32) or
    "double" (F64); None writes the checkpoint's precision. Returns {dtype, parameters}."""
    return _core.export_hf(str(checkpoint_path), str(hf_dir), _precision(dtype))
