"""EXL2 (exllamav2's format) against exllamav2 itself: tests/data/exl2 holds three checkpoints its converter made
from one tiny Llama (2.5, 4.0 and 6.0 bpw: widths 2, 3, 4, 5, 6 and 8 between them), the sha256 of the fp16
weights its `get_weight_tensor_dq()` reconstructed for every linear, and its logits for a fixed prompt (taken
without a cache, so not causal; tests/data/exl2/README.md says how they were made).

Dequantization is compared bit for bit: exllamav2 computes each weight as two fp16 products of exact small
integers and fp16 values, and the torch reference rounds the same exact products to fp16 once each.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Dict

import pytest
import torch
from safetensors.torch import load_file, save_file

from kobold_backend.engine.exl2 import load_exl2_linear
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.exl2_weight import EXL2Weight, exl2_dequantize
from tests.fixtures.hf_oracle import greedy_both, hf_load, row_rel_err

DATA = Path(__file__).resolve().parent / "data" / "exl2"
REFERENCE = json.loads((DATA / "reference.json").read_text())
PROMPT = torch.tensor([REFERENCE["prompt_ids"]])
BPWS = ("2.5", "4.0", "6.0")


def folder(bpw: str) -> Path:
    return DATA / f"exl2-{bpw}"


def linears(bpw: str) -> Dict[str, EXL2Weight]:
    """Every EXL2 linear of a fixture, read by the engine's loader (on the CPU, fp32 bias)."""
    out = {}
    with WeightReader(folder(bpw)) as reader:
        for name in REFERENCE["dq_sha256"][bpw]:
            k = reader.shape(f"{name}.q_invperm")[0]
            n = 1024 if name == "lm_head" else reader.shape(f"{name}.q_weight")[1]
            out[name] = load_exl2_linear(reader, name, k, n, torch.float32, "cpu")
    return out


def as_exllamav2_holds_it(name: str, w: Dict[str, EXL2Weight]) -> torch.Tensor:
    """Our dequantized weight [in, out] laid out as exllamav2 keeps it after loading: its MLP drops down_proj's
    input permutation and permutes gate/up's outputs instead (the product is the same), so its reconstruction
    of those three is ours with down_proj's permutation applied."""
    dense = exl2_dequantize(w[name]).t()
    if ".mlp." not in name:
        return dense
    perm = w[name.rsplit(".", 1)[0] + ".down_proj"].perm
    return dense[perm] if name.endswith("down_proj") else dense[:, perm]


@pytest.mark.parametrize("bpw", BPWS)
def test_dequantization_equals_exllamav2_bit_for_bit(bpw: str) -> None:
    w = linears(bpw)
    widths = set()
    for name, digest in REFERENCE["dq_sha256"][bpw].items():
        ours = as_exllamav2_holds_it(name, w).contiguous().numpy().tobytes()
        assert hashlib.sha256(ours).hexdigest() == digest, name
        widths |= set(w[name].groups.bits)
    assert widths == {"2.5": {2, 3, 6, 8}, "4.0": {2, 3, 4, 6, 8}, "6.0": {5, 6, 8}}[bpw]


def dense_copy(bpw: str, dest: Path) -> Path:
    """The fixture as a dense fp32 Llama folder: our dequantized weights (equal to exllamav2's, see above), its
    embeddings and norms, for transformers."""
    tensors = {k: v.float() for k, v in load_file(str(folder(bpw) / "output.safetensors")).items()
               if k.endswith("norm.weight") or k.endswith("layernorm.weight") or k == "model.embed_tokens.weight"}
    for name, w in linears(bpw).items():
        tensors[f"{name}.weight"] = exl2_dequantize(w).float()
    dest.mkdir()
    save_file(tensors, str(dest / "model.safetensors"))
    config = json.loads((folder(bpw) / "config.json").read_text())
    config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("bpw", ("2.5", "4.0"))
def test_logits_and_greedy_tokens_equal_transformers_on_the_dequantized_weights(bpw: str, tmp_path: Path) -> None:
    lm = load_model(folder(bpw), device="cpu", with_tokenizer=False)
    ref = hf_load(dense_copy(bpw, tmp_path / "dense"))
    run = greedy_both(lm, ref, PROMPT, steps=8, cuts=(5,))
    assert run.tokens == run.ref_tokens
    assert row_rel_err(torch.stack(run.logits), torch.stack(run.ref_logits)) < 1e-4
    assert row_rel_err(run.last_chunk, run.ref_prompt[:, 5:]) < 1e-4


@pytest.mark.parametrize("bpw", BPWS)
def test_exllamav2s_logits_are_those_of_the_weights_we_read(bpw: str, tmp_path: Path) -> None:
    """exllamav2's saved logits come from its forward without a cache, which attends to the whole input (no causal
    mask); transformers run the same way (an all-zero 4-D mask) on our dequantized weights gives them within fp16
    noise: the model we read is the model exllamav2 runs."""
    ref = hf_load(dense_copy(bpw, tmp_path / "dense"))
    with torch.no_grad():
        ours = ref(PROMPT, attention_mask=torch.zeros(1, 1, PROMPT.shape[1], PROMPT.shape[1])).logits
        causal = ref(PROMPT).logits
    theirs = load_file(str(DATA / "reference-logits.safetensors"))[bpw]
    assert row_rel_err(ours, theirs) < 5e-3
    assert row_rel_err(causal, theirs) > 0.1  # the saved logits are indeed not causal ones


def test_load_log_names_the_format_and_bits_per_weight() -> None:
    lm = load_model(folder("4.0"), device="cpu", with_tokenizer=False)
    fmt = lm.weight_format
    assert fmt is not None and fmt.name == "EXL2"
    assert set(fmt.detail[: -len("-bit")].split("+")) == {"2", "3", "4", "8"}  # the 6-bit head is not a layer
    w = [t for layer in lm.model.layers for t in layer.tensors() if isinstance(t, EXL2Weight)]
    stored = sum(t.file_bits for t in w) / sum(t.in_features * t.out_features for t in w)
    assert fmt.bits_per_weight == pytest.approx(stored)
    assert 3.9 < fmt.bits_per_weight < 4.6  # exllamav2 aimed at 4.0 over the whole model, head at 6 bits
    assert str(fmt).startswith("EXL2 ") and str(fmt).endswith(" bpw")


def broken_copy(tmp_path: Path, change) -> Path:
    """The 4.0 fixture with its tensors changed by `change(dict)`."""
    dest = tmp_path / "broken"
    shutil.copytree(folder("4.0"), dest)
    tensors = load_file(str(dest / "output.safetensors"))
    change(tensors)
    save_file(tensors, str(dest / "output.safetensors"))
    return dest


Q = "model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop(f"{Q}.q_scale"), f"{Q} is EXL2 but {Q}.q_scale is missing from the checkpoint."),
    (lambda t: [t.pop(f"{Q}.q_groups"), t.pop(f"{Q}.q_invperm")],
     f"{Q} is EXL2 but {Q}.q_groups, {Q}.q_invperm are missing from the checkpoint."),
    (lambda t: t[f"{Q}.q_groups"].__setitem__(0, 7), f"{Q}: q_groups holds bit widths [7]; EXL2 widths are "
                                                     "[2, 3, 4, 5, 6, 8]."),
    (lambda t: t.__setitem__(f"{Q}.q_weight", t[f"{Q}.q_weight"][:-1].clone()),
     f"{Q}: q_weight's 17 word rows do not hold the 256 input rows q_groups describes."),
    (lambda t: t.__setitem__(f"{Q}.q_scale", t[f"{Q}.q_scale"].float()),
     f"{Q}.q_scale has dtype torch.float32; EXL2 stores torch.int32."),
    (lambda t: t[f"{Q}.q_invperm"].__setitem__(0, 1), f"{Q}.q_invperm is not a permutation of its 256 input rows."),
    (lambda t: t.__setitem__(f"{Q}.q_weight", t[f"{Q}.q_weight"][:, :128].clone()),
     f"{Q}.q_weight has shape (18, 128); 256 output features need [rows, 256]."),
])
def test_malformed_exl2_is_one_sentence_naming_the_tensor(tmp_path: Path, change, message: str) -> None:
    with pytest.raises(ModelFormatError) as err:
        load_model(broken_copy(tmp_path, change), device="cpu", with_tokenizer=False)
    assert str(err.value) == message


@pytest.mark.gpu
@pytest.mark.parametrize("bpw", BPWS)
def test_cuda_kernels_against_the_torch_reference(bpw: str) -> None:
    from kobold_backend.ops.native import cuda_kernels

    kern = cuda_kernels()
    assert kern is not None, "the CUDA kernels did not load"
    gen = torch.Generator().manual_seed(0)
    for name, w in linears(bpw).items():
        w = w.to("cuda")
        w.bias = None
        ref = exl2_dequantize(w)  # fp16 [N, K]
        assert torch.equal(kern.exl2_dequantize(w).t(), ref), name  # same fp16 roundings on both sides
        for m in (1, 2, 3, 4, 7):
            x = torch.randn(m, w.in_features, generator=gen).half().cuda()
            want = x.double() @ ref.double().t()
            got = kern.exl2_matmul(x, w).double()
            assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 2e-3, (name, m)


@pytest.mark.gpu
@pytest.mark.parametrize("bpw", BPWS)
def test_cuda_prefill_and_decode_logits_match_the_cpu_path(bpw: str) -> None:
    """Prefill all but the last prompt token (dequantize + cuBLAS), then decode the last (the GEMV), in fp16,
    against the CPU fp32 forward that the transformers test above ties to the dequantized weights."""
    lm = load_model(folder(bpw), device="cuda", with_tokenizer=False)
    cache = lm.model.new_cache()
    prefill = lm.model.forward(PROMPT[:, :-1].cuda(), cache, last_only=False)
    step = lm.model.forward(PROMPT[:, -1:].cuda(), cache)
    ours = torch.cat([prefill, step[:, -1:]], dim=1).float().cpu()
    cpu = load_model(folder(bpw), device="cpu", with_tokenizer=False)
    ref = cpu.model.forward(PROMPT, cpu.model.new_cache(), last_only=False)
    assert row_rel_err(ours, ref) < 5e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


ALL_WIDTHS = ((8, 0.1, 32), (6, 0.1, 32), (5, 0.2, 64), (4, 0.2, 32), (3, 0.2, 64), (2, 0.2, 32))


def synthetic_linear(k: int, n: int, tmp: Path, device: str = "cpu") -> EXL2Weight:
    """A random linear in every width, n padded to a multiple of 32 (tensors written and read back by the loader)."""
    from kobold_backend.bench.exl2_checkpoint import exl2_tensors

    gen = torch.Generator().manual_seed(k + n)
    tensors = {f"lin.{name}": t for name, t in exl2_tensors(k, n, ALL_WIDTHS, gen, "cpu").items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    with WeightReader(tmp) as reader:
        return load_exl2_linear(reader, "lin", k, n, torch.float16, device)


def test_dequantization_reads_the_bit_stream_as_written_down(tmp_path: Path) -> None:
    """Against a direct reading of docs/exl2.md, value by value: row i of a b-bit group is bits [i*b, i*b + b) of
    the column's stream of 32-bit words."""
    k, n = 320, 40
    w = synthetic_linear(k, n, tmp_path)
    assert w.stored_columns == 64 and set(w.groups.bits) == {2, 3, 4, 5, 6, 8}
    words = w.q_weight.to(torch.int64) & 0xFFFFFFFF
    codes = [[(int(w.q_scale[g, c // 8]) >> (4 * (c % 8))) & 15 for c in range(n)] for g in range(len(w.groups.bits))]
    want = torch.empty(k, n, dtype=torch.float16)
    for g, (b, row, rows, qrow) in enumerate(zip(w.groups.bits, w.groups.row, w.groups.rows, w.groups.qrow)):
        smax = torch.tensor(float(w.q_scale_max[g]) / 256).half()
        for c in range(n):
            stream = sum(int(words[qrow + j, c]) << (32 * j) for j in range(-(-rows * b // 32)))
            scale = (torch.tensor(float((codes[g][c] + 1) ** 2)).half() * smax).half()
            for i in range(rows):
                q = (stream >> (i * b)) & ((1 << b) - 1)
                want[int(w.perm[row + i]), c] = (torch.tensor(float(q - (1 << (b - 1)))).half() * scale).half()
    assert torch.equal(exl2_dequantize(w).t(), want)


@pytest.mark.gpu
def test_cuda_gemv_on_a_large_mixed_width_linear(tmp_path: Path) -> None:
    """Split-K over many chunks, every width, padded columns: GEMV and dequantization against the reference."""
    from kobold_backend.ops.native import cuda_kernels

    kern = cuda_kernels()
    w = synthetic_linear(4096, 4000, tmp_path, "cuda")
    ref = exl2_dequantize(w)
    assert torch.equal(kern.exl2_dequantize(w).t(), ref)
    for m in (1, 4):
        x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(m)).half().cuda()
        want = x.double() @ ref.double().t()
        got = kern.exl2_matmul(x, w).double()
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-3


def test_layer_planner_counts_exl2_linears_as_loaded() -> None:
    """device_map's byte count of a layer (what --gpu-split plans with) equals what the loader placed."""
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.device_map import Sizes, checkpoint_shapes

    lm = load_model(folder("4.0"), device="cpu", with_tokenizer=False)
    sizes = Sizes(ModelConfig.from_dir(folder("4.0")), checkpoint_shapes(folder("4.0")), max_seq_len=64)
    for i, layer in enumerate(lm.model.layers):
        loaded = sum(t.nbytes if isinstance(t, EXL2Weight) else t.numel() * t.element_size() for t in layer.tensors())
        assert sizes.layer(i, 4) == loaded
    assert not sizes.tied() and sizes.linear("lm_head", 4) == lm.model.lm_head.nbytes


def test_older_conversions_without_quantization_config_load_by_their_tensors(tmp_path: Path) -> None:
    """exllamav2 releases before the converter wrote quantization_config: the q_weight tensors say EXL2, and the
    United folder check accepts the folder."""
    from kobold_backend.host.backend import check_model_folder

    dest = tmp_path / "old"
    shutil.copytree(folder("4.0"), dest)
    config = json.loads((dest / "config.json").read_text())
    del config["quantization_config"]
    (dest / "config.json").write_text(json.dumps(config))
    assert check_model_folder(dest) is None
    lm = load_model(dest, device="cpu", with_tokenizer=False)
    assert lm.config.quant is not None and lm.config.quant.method == "exl2"
    ref = load_model(folder("4.0"), device="cpu", with_tokenizer=False)
    ids = PROMPT[:, :4]
    assert torch.equal(lm.model.forward(ids, lm.model.new_cache()), ref.model.forward(ids, ref.model.new_cache()))


def test_bench_writer_makes_a_loadable_4_bpw_folder_widest_groups_first(tmp_path: Path) -> None:
    """The synthetic folder `kobold-backend bench --format exl2` times: it loads, its groups come widest first (as
    exllamav2's kernels need, so the same folder runs there), and a Llama-shaped layer stack is about 4.0 bpw."""
    from kobold_backend.bench.checkpoint import Shape
    from kobold_backend.bench.exl2_checkpoint import write_synthetic_exl2

    path = write_synthetic_exl2(tmp_path / "tiny", Shape(512, 1376, 2, 4, 4, 256), device="cpu")
    lm = load_model(path, device="cpu", with_tokenizer=False)
    for layer in lm.model.layers:
        for w in layer.tensors():
            if isinstance(w, EXL2Weight):
                assert list(w.groups.bits) == sorted(w.groups.bits, reverse=True)
    assert lm.weight_format is not None and lm.weight_format.name == "EXL2"
    assert 3.9 < lm.weight_format.bits_per_weight < 4.3
