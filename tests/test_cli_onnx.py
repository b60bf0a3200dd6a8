"""`mhagen import-onnx --sample-input NAME=FILE.npy`: models with token-id inputs import from
the command line, and the importer's advice names the command's flags, not import_onnx()'s
keywords."""
import io
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest

from mhagen.cli import main
from mhagen.onnx.cli import _in_cli_words
from mhagen.onnx.fit import VARIED_INPUTS_HINT
from tests.test_onnx_import import column_scaled_model

IDS = np.array([[1, 2, 3, 4]], np.int64)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "mhagen", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def readable_ids_model(tmp_path):
    """Token ids -> embedding -> one attention head whose weights sit in initializers."""
    model, w, _ = column_scaled_model(ids=True)
    for n in model.graph.node:          # no column scaling: Q is readable
        if n.name == "scores":
            n.input[0] = "q"
    onnx.save(model, tmp_path / "ids.onnx")
    np.save(tmp_path / "ids.npy", IDS)
    return tmp_path / "ids.onnx", w


def test_a_token_id_model_needs_and_takes_a_sample_input(tmp_path):
    path, w = readable_ids_model(tmp_path)
    r = cli("import-onnx", path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "model input 'ids' is not floating point; pass --sample-input ids=FILE.npy" \
        in r.stderr
    assert "sample_inputs" not in r.stderr and "import_onnx" not in r.stderr
    r = cli("import-onnx", path, "--sample-input", f"ids={tmp_path / 'ids.npy'}", "--out",
            tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "weights read exactly from the initializers" in r.stdout
    (npz,) = (tmp_path / "out").glob("*.npz")
    with np.load(npz) as found:
        for role in "qkv":
            np.testing.assert_array_equal(found[f"w_{role}"][0], w[role])
        np.testing.assert_array_equal(found["w_o"], w["o"])


@pytest.mark.parametrize("spec,fragment", [
    ("ids", "--sample-input takes NAME=FILE.npy (e.g. input_ids=ids.npy), not 'ids'"),
    ("tokens={npy}", "the model has no input 'tokens'; its inputs: ids"),
    ("ids={dir}/none.npy", "cannot read"),
], ids=["no-file", "unknown-name", "missing-file"])
def test_bad_sample_inputs_are_one_line(spec, fragment, tmp_path, capsys):
    path, _ = readable_ids_model(tmp_path)
    spec = spec.format(npy=tmp_path / "ids.npy", dir=tmp_path)
    assert main(["import-onnx", str(path), "--sample-input", spec]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_a_float_input_is_not_sampled(tmp_path, capsys):
    model, _, _ = column_scaled_model()
    onnx.save(model, tmp_path / "x.onnx")
    np.save(tmp_path / "x.npy", np.zeros((1, 4, 8), np.float32))
    assert main(["import-onnx", str(tmp_path / "x.onnx"), "--sample-input",
                 f"x={tmp_path / 'x.npy'}"]) == 2
    assert "'x' is a floating-point input, probed with random values" in \
        capsys.readouterr().err


def test_repeated_sample_inputs_are_several_samples_for_a_fit(tmp_path, capsys):
    """A model whose weights must be fitted needs varied token ids: the advice says to repeat
    the flag, and repeating it (one file per sample) makes the fit."""
    pytest.importorskip("onnxruntime")
    model, w, cols = column_scaled_model(ids=True)
    onnx.save(model, tmp_path / "fit.onnx")
    np.save(tmp_path / "one.npy", IDS)
    assert main(["import-onnx", str(tmp_path / "fit.onnx"), "--sample-input",
                 f"ids={tmp_path / 'one.npy'}"]) == 2
    err = capsys.readouterr().err
    assert "give more varied samples: repeat --sample-input NAME=FILE.npy with other " \
           "arrays" in err and "sample_inputs" not in err, err
    rng = np.random.default_rng(5)
    flags = []
    for k in range(12):
        np.save(tmp_path / f"s{k}.npy", rng.choice(50, size=(1, 4), replace=False))
        flags += ["--sample-input", f"ids={tmp_path / f's{k}.npy'}"]
    assert main(["import-onnx", str(tmp_path / "fit.onnx"), *flags, "--out",
                 str(tmp_path / "out")]) == 0
    assert "fitted by least squares" in capsys.readouterr().out
    (npz,) = (tmp_path / "out").glob("*.npz")
    with np.load(npz) as found:
        np.testing.assert_allclose(found["w_q"][0], w["q"] * cols, atol=1e-4)


@pytest.mark.slow
def test_a_bert_export_imports_from_the_command_line(tmp_path):
    """Issue 60: a 1-layer BERT exported with token ids (random config) imported by
    mhagen.import_onnx(..., sample_inputs=...) failed from the command line."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")).eval()

    class Ids(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state

    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Ids().eval(), (ids,), buf, dynamo=False, opset_version=17,
                          input_names=["input_ids"], output_names=["y"])
    (tmp_path / "bert.onnx").write_bytes(buf.getvalue())
    np.save(tmp_path / "ids.npy", ids.numpy())
    r = cli("import-onnx", tmp_path / "bert.onnx")
    assert r.returncode == 2 and "--sample-input input_ids=FILE.npy" in r.stderr, r.stderr
    r = cli("import-onnx", tmp_path / "bert.onnx", "--sample-input",
            f"input_ids={tmp_path / 'ids.npy'}", "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "1 attention layer" in r.stdout and "read exactly from the initializers" in r.stdout
    assert "num_heads=4" in r.stdout and len(list((tmp_path / "out").glob("*.npz"))) == 1


@pytest.mark.parametrize("message,expected", [
    ("the probe rows span 4 of the 8 directions; " + VARIED_INPUTS_HINT,
     "the probe rows span 4 of the 8 directions; give more varied samples: repeat "
     "--sample-input NAME=FILE.npy with other arrays (e.g. several batches of different token "
     "ids), so the probe rows span the layer input"),
    ("cannot run the model on inputs of shapes {}; if the model only runs at the sequence "
     "length it was exported with, pass that length as seq_len=",
     "cannot run the model on inputs of shapes {}; if the model only runs at the sequence "
     "length it was exported with, pass that length as --seq-len"),
    ("import with a seq_len longer than the model's farthest distinct distance (T5: "
     "max_distance 128, so seq_len=160)",
     "import with a --seq-len longer than the model's farthest distinct distance (T5: "
     "max_distance 128, so --seq-len 160)"),
    ("seq_len=1 must be an integer >= 2", "--seq-len 1 must be an integer >= 2"),
    ("batch=0 must be a positive integer", "--batch 0 must be a positive integer"),
], ids=["varied", "exported-length", "t5-length", "seq-len", "batch"])
def test_the_importers_advice_names_the_commands_flags(message, expected):
    assert _in_cli_words(message) == expected
