from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extractor.demo import DEMO_JOB
from extractor.errors import SpecError
from extractor.spec.load import apply_overrides, load_spec, parse_spec
from extractor.spec.schema import auto_chunk_rows

BASE = {"data": {"root": "images"}, "capture": [{"layer": "layer3"}]}


def test_defaults_fill_in():
    spec = parse_spec(BASE)
    assert spec.model.name == "resnet18" and spec.model.weights == "auto"
    assert spec.data.crop == "auto" and spec.data.shard_size == 1024
    assert spec.capture[0].what == "output" and spec.capture[0].reduce == "none"
    assert spec.output.store == "out.zarr" and spec.cluster.backend == "ray"


def test_spec_is_frozen():
    spec = parse_spec(BASE)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        spec.data.batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "path", "words"),
    [
        ({**BASE, "modle": {}}, "modle", "unknown key"),
        ({**BASE, "data": {"root": "x", "batchsize": 3}}, "data.batchsize", "unknown key"),
        ({**BASE, "capture": [{"layer": "a"}, {"layer": "b", "reduce": "avg"}]}, "capture[1].reduce", "'mean'"),
        ({**BASE, "capture": [{"layer": "a", "dtype": "int8"}]}, "capture[0].dtype", "float16"),
        ({**BASE, "capture": [{"layer": "a", "what": "gradcam", "dtype": "bfloat16"}]}, "capture[0]",
         "gradcam map is stored as float32"),
        ({**BASE, "data": {"root": "x", "batch_size": "many"}}, "data.batch_size", "integer"),
        ({**BASE, "data": {"root": "x", "batch_size": 0}}, "data.batch_size", "greater than 0"),
        ({"data": {"root": "x"}}, "capture", "missing"),
        ({**BASE, "capture": [{"reduce": "mean"}]}, "capture[0].layer", "missing"),
        ({**BASE, "data": {"source": "folder"}}, "data", "data.root"),
        ({**BASE, "output": {"chunk_rows": 300}}, "chunk_rows", "divide"),
        ({**BASE, "output": {"chunk_rows": 0}}, "output.chunk_rows", "expected auto or a number >= 1"),
        ({**BASE, "data": {"root": "x", "jpeg_draft": "maybe"}}, "data.jpeg_draft", "boolean"),
        ({**BASE, "model": {"factory": "not a factory"}}, "model", "pkg.module:function"),
    ],
)
def test_bad_specs_name_the_field(raw, path, words):
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    msg = str(err.value)
    assert path in msg and words in msg, msg


def test_unknown_key_lists_valid_keys():
    with pytest.raises(SpecError, match=r"capture\[0\]\.layers: unknown key \(valid keys here: layer, what"):
        parse_spec({**BASE, "capture": [{"layers": "x"}]})


def test_overrides_paths_and_types():
    raw = apply_overrides(
        {**BASE, "capture": [{"layer": "a"}, {"layer": "b"}]},
        ["data.batch_size=16", "capture[1].reduce=mean", "capture.0.dtype=float16", "model.weights=null",
         "data.mean=[0.5, 0.5, 0.5]"],
    )
    spec = parse_spec(raw)
    assert spec.data.batch_size == 16
    assert spec.capture[1].reduce == "mean" and spec.capture[0].dtype == "float16"
    assert spec.data.mean == (0.5, 0.5, 0.5)
    with pytest.raises(SpecError, match=r"capture\[5\] does not exist"):
        apply_overrides(BASE, ["capture[5].reduce=mean"])
    with pytest.raises(SpecError, match="KEY=VALUE"):
        apply_overrides(BASE, ["data.batch_size"])


def test_load_spec_errors(tmp_path: Path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "missing.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(SpecError, match="is empty"):
        load_spec(tmp_path / "empty.yaml")
    (tmp_path / "bad.yaml").write_text("data: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")
    # a safe loader: python tags are refused, never executed
    (tmp_path / "evil.yaml").write_text("data: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "evil.yaml")


def test_jobs_demo_yaml_is_the_demo_job():
    repo = Path(__file__).resolve().parents[2]
    assert (repo / "jobs" / "demo.yaml").read_text() == DEMO_JOB
    spec = load_spec(repo / "jobs" / "demo.yaml", ["model.device=cpu"])
    assert spec.data.shard_size % spec.output.chunk_rows == 0
    assert yaml.safe_load(DEMO_JOB)["capture"][1]["layer"] == "layer4.*.conv2"


def test_content_digest_ignores_run_only_fields():
    from extractor.spec.identity import spec_digest

    a = parse_spec(BASE)
    b = parse_spec(apply_overrides(BASE, ["data.batch_size=7", "model.device=cpu", "output.if_exists=resume"]))
    c = parse_spec(apply_overrides(BASE, ["capture[0].reduce=mean"]))
    assert spec_digest(a) == spec_digest(b) != spec_digest(c)


def test_every_job_in_jobs_folder_is_valid():
    repo = Path(__file__).resolve().parents[2]
    specs = sorted((repo / "jobs").glob("*.yaml"))
    assert len(specs) >= 2
    for path in specs:
        load_spec(path)


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path):
    """A second `data:` section would silently replace the first (crop, batch size... lost)."""
    path = tmp_path / "job.yaml"
    path.write_text("data: {root: imgs, crop: 64}\ncapture:\n  - {layer: layer4}\ndata: {root: imgs}\n")
    with pytest.raises(SpecError, match=r"(?s)key 'data' first given.*line 1.*is given again.*line 4"):
        load_spec(path)
    path.write_text("data: {root: imgs, crop: 64, crop: 32}\ncapture:\n  - {layer: layer4}\n")
    with pytest.raises(SpecError, match="key 'crop'"):
        load_spec(path)


def test_true_is_not_a_number_and_bool_fields_still_take_bools():
    with pytest.raises(SpecError, match=r"data\.batch_size: expected an integer, not true"):
        parse_spec({**BASE, "data": {"root": "x", "batch_size": True}})
    with pytest.raises(SpecError, match=r"output\.lease_timeout_s: expected a number, not false"):
        parse_spec({**BASE, "output": {"lease_timeout_s": False}})
    spec = parse_spec({**BASE, "model": {"channels_last": False, "compile": True}})
    assert spec.model.channels_last is False and spec.model.compile is True


def test_an_invalid_capture_entry_gives_one_line_not_a_spurious_empty_list_error():
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, "capture": [{"layer": "layer3", "reduce": "meen"}]})
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].startswith("capture[0].reduce:")


def test_a_crop_larger_than_the_resize_is_refused():
    with pytest.raises(SpecError, match=r"data\.crop \(300\) is larger than data\.resize \(72\)"):
        parse_spec({**BASE, "data": {"root": "x", "resize": 72, "crop": 300}})
    assert parse_spec({**BASE, "data": {"root": "x", "resize": None, "crop": 300}}).data.crop == 300


def test_yaml_merge_keys_still_load_and_may_be_overridden(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("data: {<<: {root: imgs, crop: 64, resize: null}, crop: 32}\ncapture:\n  - {layer: layer4}\n")
    spec = load_spec(path)
    assert spec.data.crop == 32 and spec.data.root == "imgs" and spec.data.resize is None
    path.write_text("? [a, b]\n: 1\n")  # an unhashable key: YAML's own error, not a crash
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path)


def test_true_inside_a_list_of_numbers_is_refused():
    with pytest.raises(SpecError, match=r"data\.mean: expected numbers, not \['true', 0\.4, 0\.4\]"):
        parse_spec({**BASE, "data": {"root": "x", "mean": [True, 0.4, 0.4]}})


def test_the_docs_spec_is_valid_and_names_every_field():
    """The docs' spec (the job spec's reference page) is what users copy: it parses, and it shows every section's
    fields."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "spec.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    full = next(b for b in blocks if b.startswith("model:"))
    raw = yaml.safe_load(full)
    spec = parse_spec(raw)  # no unknown key, no bad value
    assert [c.layer for c in spec.capture] == ["layer3", "layer4.*.conv2", "avgpool"]
    shown = {section: set(raw[section]) for section in ("model", "data", "output", "cluster", "submit")}
    for section, keys in shown.items():
        fields = set(type(getattr(spec, section)).model_fields)
        hidden = {"max_image_pixels", "compression_level", "lease_timeout_s"}  # named in the prose instead
        assert fields - hidden <= keys, f"{section}: the docs' spec does not show {sorted(fields - hidden - keys)}"
    for block in blocks[blocks.index(full) + 1:]:  # the later fragments parse as parts of a spec
        part = yaml.safe_load(block)
        parse_spec({**raw, **{k: ({**raw[k], **v} if isinstance(v, dict) else v) for k, v in part.items()}})


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "jobs").glob("*.yaml")))
def test_the_example_jobs_parse_and_their_layers_exist_in_their_models(name: str, tmp_path: Path):
    """Hub models that are not in the local cache are checked on a small config of the same class
    (layer names do not depend on the width; the jobs' globs need only the blocks to exist)."""
    import torch

    from extractor.model import TokenLayout, claim_of, layer_tokens, token_facts
    from extractor.model.build import build_model, module_outputs
    from extractor.model.targets import resolve_targets

    spec = load_spec(str(Path(__file__).resolve().parents[2] / "jobs" / name))
    update: dict = {"weights": None, "device": "cpu"}
    if spec.model.source == "hf":
        t = pytest.importorskip("transformers")
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 12, "num_attention_heads": 2,
                  "image_size": 32, "patch_size": 8}
        text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "vocab_size": 99}
        small = {"openai/clip-vit-base-patch16": lambda: t.CLIPConfig(vision_config=vision, text_config=text),
                 "google/siglip-base-patch16-224": lambda: t.SiglipConfig(vision_config=vision, text_config=text),
                 "facebook/dinov2-with-registers-base": lambda: t.Dinov2WithRegistersConfig(**vision)}
        small[spec.model.model]().save_pretrained(tmp_path / "hf")
        update["name"] = f"hf:{tmp_path / 'hf'}"
    model, _ = build_model(spec.model.model_copy(update=update))
    size = (32, 32) if name.startswith(("clip", "siglip", "dinov2")) else (224, 224)
    targets = resolve_targets(model, spec.capture)
    assert len(targets) >= len(spec.capture)  # every entry (globs expand to one or more)
    if any(t.drop_prefix or t.sample for t in targets):  # each such layer's patch tokens are known
        facts, claim = token_facts(model, size), claim_of(model, None)
        lengths = {n: out.shape[1] for n, _, out in module_outputs(model, torch.zeros(1, 3, *size))
                   if isinstance(out, torch.Tensor) and out.ndim == 3}
        assert all(isinstance(layer_tokens(lengths[t.layer], facts, claim), TokenLayout) for t in targets
                   if t.drop_prefix or t.sample)
    if name.startswith("vit"):
        assert len(targets) == 12 and all(t.reduce == "cls" for t in targets)
    if name.startswith("resnet50"):
        assert [t.key for t in targets][:4] == ["layer1", "layer2", "layer3", "layer4"]


def test_decode_workers_is_auto_or_a_count():
    from extractor.compute.worker import MAX_DECODE_THREADS, decode_threads

    assert parse_spec(BASE).data.decode_workers == "auto"
    assert parse_spec({**BASE, "data": {"root": "x", "decode_workers": 0}}).data.decode_workers == 0
    for bad, words in ((-1, "auto or a number >= 0"), (True, "integer"), ("many", "auto")):
        with pytest.raises(SpecError, match=f"data.decode_workers.*{words}"):
            parse_spec({**BASE, "data": {"root": "x", "decode_workers": bad}})
    assert decode_threads("auto", cpus=6) == 6 and decode_threads("auto", cpus=500) == MAX_DECODE_THREADS
    assert decode_threads(3, cpus=6) == 3 and decode_threads(0) == 0
    import os

    assert decode_threads("auto") == min(len(os.sched_getaffinity(0)), MAX_DECODE_THREADS)


def test_secrets_are_redacted_in_the_public_spec_and_in_command_lines():
    from extractor.spec.identity import REDACTED, redact_argv

    raw = {**BASE, "data": {"root": "x", "storage_options": {"secret": "s1", "endpoint_url": "http://e"}},
           "submit": {"env_vars": {"AWS_SECRET_ACCESS_KEY": "s2", "OMP_NUM_THREADS": "4"}}}
    raw["data"]["storage_options"]["client_kwargs"] = {"region_name": "eu", "aws_secret_access_key": "s6"}
    public = parse_spec(raw).public_dict()
    assert public["data"]["storage_options"].pop("client_kwargs") == {"region_name": "eu",
                                                                    "aws_secret_access_key": REDACTED}
    assert public["data"]["storage_options"] == {"secret": REDACTED, "endpoint_url": "http://e"}
    assert public["submit"]["env_vars"] == {"AWS_SECRET_ACCESS_KEY": REDACTED, "OMP_NUM_THREADS": "4"}
    argv = ["extractor", "run", "job.yaml", "--set", "data.storage_options.secret=s1", "--set",
            "output.storage_options.endpoint_url=http://e", "--set=submit.env_vars.TOKEN=s2", "--set",
            "data.storage_options={key: k, secret: s3}", "--set", "data.batch_size=8", "--set",
            "submit={env_vars: {HF_TOKEN: s4}}", "--set",
            "data.storage_options.client_kwargs={aws_secret_access_key: s5}",
            "-q"]
    shown = " ".join(redact_argv(argv))
    assert not {"s1", "s2", "s3", "s4", "s5"} & set(shown.replace("=", " ").replace(",", " ").replace("}", " ").split())
    assert f"data.storage_options.secret={REDACTED}" in shown and f"--set=submit.env_vars.TOKEN={REDACTED}" in shown
    assert "output.storage_options.endpoint_url=http://e" in shown and "data.batch_size=8" in shown


def test_only_env_vars_that_look_like_secrets_are_redacted_so_a_printed_command_pastes_back():
    """issue 37, case 13: every submit.env_vars value was redacted (and warned of), PATH and the README's own
    EXTRACTOR_PROGRESS_S included, so the printed resume line could not be pasted back. Only what looks like a
    credential, by its name or its value, is redacted, as storage options' secrets are."""
    from extractor.spec.identity import REDACTED, looks_secret, redact_argv
    from extractor.spec.load import apply_overrides

    env = {"PATH": "/opt/venv/bin:/usr/bin:/bin", "EXTRACTOR_PROGRESS_S": "60", "OMP_NUM_THREADS": "4",
           "HF_HOME": "/data/hf", "CUDA_VISIBLE_DEVICES": "0,1", "LOG_LEVEL": "debug",
           "HF_TOKEN": "x", "OPENAI_API_KEY": "x", "PGPASSWORD": "x", "AWS_ACCESS_KEY_ID": "x",  # by name
           "MY_ID": "AKIAIOSFODNN7EXAMPLE", "DB": "postgres://app:hunter2@db:5432/x", "UPLOAD": "hf_abcdef",  # value
           "BLOB": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "HEXED": "0123456789abcdef" * 2}
    public = parse_spec({**BASE, "data": {"root": "x"}, "submit": {"env_vars": env}}).public_dict()
    kept = {k for k, v in public["submit"]["env_vars"].items() if v != REDACTED}
    assert kept == {"PATH", "EXTRACTOR_PROGRESS_S", "OMP_NUM_THREADS", "HF_HOME", "CUDA_VISIBLE_DEVICES", "LOG_LEVEL"}
    assert all(public["submit"]["env_vars"][k] == env[k] for k in kept)
    assert [k for k, v in env.items() if looks_secret(k, v)] == [k for k in env if k not in kept]
    argv = ["--set", "submit.env_vars.PATH=/opt/venv/bin:/usr/bin", "--set", "submit.env_vars.EXTRACTOR_PROGRESS_S=60",
            "--set", "submit.env_vars.HF_TOKEN=hf_s3cr3t"]
    shown = redact_argv(argv)
    assert shown[:4] == argv[:4] and shown[5] == f"submit.env_vars.HF_TOKEN={REDACTED}"
    assert apply_overrides({}, [a for a in shown[:4] if a != "--set"])["submit"]["env_vars"] == {
        "PATH": "/opt/venv/bin:/usr/bin", "EXTRACTOR_PROGRESS_S": "60"}  # pasted back: taken as given, as text


def test_a_factory_model_has_no_name_and_older_stores_of_one_still_compare_equal():
    from extractor.spec.schema import content_of
    from extractor.store.provenance import current_form

    raw = {**BASE, "model": {"factory": "toy_models:small_cnn"}}
    spec = parse_spec(raw)
    assert spec.model.name is None  # not the default resnet18, which never ran
    stored = spec.public_dict()
    stored["model"]["name"] = "resnet18"  # what versions before this one recorded
    assert content_of(current_form(stored)) == content_of(spec.public_dict())


def test_override_paths_into_lists():
    raw = {**BASE, "capture": [{"layer": "a"}, {"layer": "b"}]}
    assert apply_overrides(raw, ["capture[-1].reduce=mean"])["capture"][1]["reduce"] == "mean"
    with pytest.raises(SpecError, match=r"data.mean is not a list in the spec .* --set 'data.mean=\[...\]'"):
        apply_overrides(raw, ["data.mean[0]=0.5"])  # unset: its default is not in the raw spec
    with pytest.raises(SpecError, match=r"capture\[2\] does not exist \(the list has 2 entries\)"):
        apply_overrides(raw, ["capture[2].reduce=mean"])


def test_a_set_value_that_is_not_yaml_is_one_line_naming_the_key():
    """issue 17, defect 11: it was a raw YAML traceback."""
    with pytest.raises(SpecError, match=r"--set data.mean: the value '\[0.5, 0.5' is not valid YAML"):
        apply_overrides({}, ["data.mean=[0.5, 0.5"])


def test_cluster_workers_auto_by_default_null_reads_as_auto_and_max_workers_caps_auto_only():
    """issue 17: workers: auto (grow on new capacity) is the default; stores written with
    workers: null resume as auto; max_workers with a fixed number is refused, naming both."""
    assert parse_spec(BASE).cluster.workers == "auto"
    assert parse_spec({**BASE, "cluster": {"workers": None}}).cluster.workers == "auto"
    assert parse_spec({**BASE, "cluster": {"workers": 3}}).cluster.workers == 3
    assert parse_spec({**BASE, "cluster": {"max_workers": 4}}).cluster.max_workers == 4
    with pytest.raises(SpecError, match=r"cluster.workers.*expected auto or a number >= 1, not 0"):
        parse_spec({**BASE, "cluster": {"workers": 0}})
    with pytest.raises(SpecError, match=r"max_workers caps workers: auto; with workers: 2"):
        parse_spec({**BASE, "cluster": {"workers": 2, "max_workers": 4}})
    with pytest.raises(SpecError, match=r"cluster.workers"):
        parse_spec({**BASE, "cluster": {"workers": "many"}})


@pytest.mark.parametrize(("shard_size", "row_bytes", "chunk_rows"), [
    (1024, 0, 256), (1000, 0, 250), (100, 0, 100), (3000, 0, 250), (4, 0, 4),  # the base: up to 256 rows
    (1024, 16384, 256), (1200, 4096, 240), (1024, 2048, 512), (1000, 2048, 500), (1200, 1024, 600),
    (2560, 64, 2560)])
def test_chunk_rows_auto_is_the_largest_divisor_of_the_shard_size_up_to_256_or_1_mib_of_small_rows(
        shard_size: int, row_bytes: int, chunk_rows: int):
    """issue 19: shard_size 100 or 1000 were refused until chunk_rows was set too; issue 20: a capture
    with small rows gets chunks of up to 1 MiB (fewer files per batch). The spec keeps ``auto``: the
    store is chunked per capture when it is made."""
    assert auto_chunk_rows(shard_size, row_bytes) == chunk_rows
    for output in ({}, {"chunk_rows": "auto"}):
        spec = parse_spec({**BASE, "data": {"root": "images", "shard_size": shard_size}, "output": output})
        assert spec.output.chunk_rows == "auto" == spec.to_dict()["output"]["chunk_rows"]


def test_chunk_rows_auto_refuses_a_shard_size_without_a_sensible_divisor_and_a_set_number_is_kept():
    with pytest.raises(SpecError, match=r"output.chunk_rows: auto needs a divisor of data.shard_size \(1009\) between "
                                        r"16 and 256, and the largest is 1"):
        parse_spec({**BASE, "data": {"root": "images", "shard_size": 1009}})
    assert parse_spec({**BASE, "output": {"chunk_rows": 128}}).output.chunk_rows == 128
    with pytest.raises(SpecError, match=r"must divide data.shard_size"):
        parse_spec({**BASE, "data": {"root": "images", "shard_size": 100}, "output": {"chunk_rows": 64}})


def test_a_redacted_secret_pasted_back_asks_for_the_secret_by_name():
    """issue 26, defect 5 (T3-2): the printed resume command holds ***redacted*** for a --set secret; pasted,
    it failed with a YAML error (an alias). Now it asks for that secret."""
    from extractor.cli.common import _command

    line = _command("run", "job.yaml", "--set", "output.storage_options.secret=hunter2", "--resume")
    assert "hunter2" not in line and "***redacted***" in line
    with pytest.raises(SpecError, match=r"--set output.storage_options.secret=\*\*\*redacted\*\*\*: "
                                        r"\*\*\*redacted\*\*\* stands for a secret that extractor never prints; "
                                        r"give its value"):
        apply_overrides(BASE, ["output.storage_options.secret=***redacted***"])
    raw = {**BASE, "output": {"storage_options": {"key": "***redacted***", "secret": "***redacted***"}}}
    with pytest.raises(SpecError, match=r"output.storage_options.key, output.storage_options.secret are "
                                        r"\*\*\*redacted\*\*\*"):
        parse_spec(raw)


def test_env_vars_take_numbers_as_text_and_set_keeps_the_text_as_typed():
    """issue 54: --set submit.env_vars.X=5 was refused as not a string (YAML read 5 as a number). An environment
    variable set on the command line is its text as typed (0022 stays 0022); a number in a file is its text;
    true and false are refused, naming the variable (which spelling a program reads varies)."""
    spec = parse_spec(apply_overrides(BASE, ["submit.env_vars.OMP_NUM_THREADS=5", "submit.env_vars.UMASK=0022",
                                             "submit.env_vars.FLAG=true", "submit.env_vars.EMPTY="]))
    assert spec.submit.env_vars == {"OMP_NUM_THREADS": "5", "UMASK": "0022", "FLAG": "true", "EMPTY": ""}
    assert apply_overrides(BASE, ["data.batch_size=5"])["data"]["batch_size"] == 5  # elsewhere: YAML, as before
    spec = parse_spec({**BASE, "submit": {"env_vars": {"OMP_NUM_THREADS": 4, "RATIO": 0.5, "PATH": "/bin"}}})
    assert spec.submit.env_vars == {"OMP_NUM_THREADS": "4", "RATIO": "0.5", "PATH": "/bin"}
    with pytest.raises(SpecError, match=r"submit.env_vars: DEBUG is True: an environment variable holds text; quote "
                                        r"the spelling the program reads, e.g. DEBUG: \"1\" or \"true\""):
        parse_spec({**BASE, "submit": {"env_vars": {"DEBUG": True}}})
