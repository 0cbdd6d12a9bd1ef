"""`hf-specdec serve` (`hf_specdec.serving`): transformers' OpenAI-compatible server whose continuous batching drafts.
Real HTTP on localhost (uvicorn, the `openai` client), the embedded zoo model from its safetensors directory; every
completion equals plain continuous batching's text for the same prompt, streamed or not, alone or concurrent."""

import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_specdec
from hf_specdec import serving, zoo
from hf_specdec.zoo.tasks import load_prompts

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = str(zoo.ZOO_DIR / "target")
NEW_TOKENS = 24
CACHE = dict(page_size=16, num_blocks=96, max_batch_tokens=256, max_requests_per_batch=4)


def prompts(count: int) -> list[str]:
    """Copy-heavy held-out prompts (a function, then its renamed signature), cut to their last 600 characters."""
    return [item["prompt"][-600:] for item in load_prompts()["editing"][:count]]


@pytest.fixture(scope="module")
def reference():
    """Plain continuous batching's completion text of each prompt (greedy, the model's EOS), as the server decodes."""
    target, _, tokenizer = zoo.load_default()
    texts = prompts(3)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    inputs = [tokenizer(text).input_ids for text in texts]
    outputs = target.generate_batch(inputs, config, ContinuousBatchingConfig(**CACHE), progress_bar=False)
    tokens = [outputs[request].generated_tokens for request in sorted(outputs, key=lambda r: int(r.split("_")[-1]))]
    return {text: tokenizer.decode(ids, skip_special_tokens=True) for text, ids in zip(texts, tokens)}


@pytest.fixture(scope="module")
def server():
    """The server on a free localhost port, in this process (so the test sees its model), 1 thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    drafting = {"drafter": "prompt_lookup", "speculative_gamma": 6, "speculative_gamma_policy": "constant"}
    app, model_manager, state = serving.build_server(
        MODEL, drafting, device="cpu", dtype="float32", continuous_batching_config=ContinuousBatchingConfig(**CACHE)
    )
    try:
        with run_server(app) as client:
            yield client, model_manager
    finally:
        state.shutdown()
        model_manager.shutdown()
        torch.set_num_threads(threads)


@contextlib.contextmanager
def run_server(app):
    """`app` under uvicorn on a free localhost port in this process; gives an `openai` client."""
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not uv.started:
            assert thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        port = uv.servers[0].sockets[0].getsockname()[1]
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


def complete(client, prompt: str, stream: bool = False) -> str:
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=stream
    )
    if stream:
        return "".join(chunk.choices[0].text for chunk in response if chunk.choices)
    return response.choices[0].text


def test_models_endpoint_lists_the_served_model(server):
    client, _ = server
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_completion_equals_plain_continuous_batching_and_drafts(server, reference):
    client, model_manager = server
    prompt = next(iter(reference))
    complete(client, prompt)  # the manager starts with the first request
    (loaded,) = model_manager.loaded_models.values()
    calls = []
    hook = loaded.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        text = complete(client, prompt)
    finally:
        hook.remove()
    assert text == reference[prompt]
    assert isinstance(loaded.model, hf_specdec.SpeculativeGenerationMixin)
    # one prefill and one call per step: plain decoding would take NEW_TOKENS - 1 steps after the prefill
    assert len(calls) < NEW_TOKENS - 1, f"{len(calls)} target calls for {NEW_TOKENS} tokens: nothing was drafted"


def test_streamed_completion_equals_plain(server, reference):
    client, _ = server
    for prompt, expected in reference.items():
        assert complete(client, prompt, stream=True) == expected


def test_concurrent_requests_each_equal_plain(server, reference):
    client, _ = server
    jobs = [(prompt, stream) for prompt in reference for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(client, *job), jobs))
    assert texts == [reference[prompt] for prompt, _ in jobs]


def test_other_model_names_are_refused(server):
    client, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="org/other", prompt="x", max_tokens=2)
    assert "pinned" in error.value.response.text


def test_a_draft_model_serves_each_request_exactly(reference):
    """A server whose continuous batching drafts with the zoo's distilled draft model (each request with a draft
    cache of its own): concurrent completions equal plain continuous batching's, and the draft model ran."""
    _, drafter, _ = zoo.load_default()
    calls = []
    hook = drafter.register_forward_hook(lambda *_: calls.append(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    drafting = {"assistant_model": drafter, "speculative_gamma": 4, "speculative_gamma_policy": "constant"}
    app, model_manager, state = serving.build_server(
        MODEL, drafting, device="cpu", dtype="float32", continuous_batching_config=ContinuousBatchingConfig(**CACHE)
    )
    try:
        with run_server(app) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = list(reference)[:2]
            assert list(pool.map(lambda text: complete(client, text), texts)) == [reference[t] for t in texts]
    finally:
        state.shutdown()
        model_manager.shutdown()
        hook.remove()
        torch.set_num_threads(threads)
    assert calls


def test_build_server_refuses_drafting_it_cannot_serve():
    with pytest.raises(ValueError, match="needs a drafter"):
        serving.build_server(MODEL, {})
    _, drafter, _ = zoo.load_default()
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        serving.build_server(MODEL, {"drafter": hf_specdec.ModelDrafter(drafter, cache_implementation="static")})
    with pytest.raises(ValueError, match="speculative_tree_budget"):
        serving.build_server(MODEL, {"drafter": "prompt_lookup", "speculative_tree_budget": 8})
    with pytest.raises(ValueError, match="is not a registered drafter|Unknown drafter|unknown drafter"):
        serving.build_server(MODEL, {"drafter": "no_such_drafter"})


def test_requests_continuous_batching_does_not_serve_go_to_generate_with_the_drafter():
    from transformers.cli.serving.utils import Modality

    drafting = {"drafter": "prompt_lookup"}
    state = serving.SpeculativeGenerationState(drafting)
    target, _, _ = zoo.load_default()
    assert state.use_continuous_batching(target, Modality.LLM)
    assert not state.use_continuous_batching(target, Modality.VLM)  # transformers' sequential fallback...
    manager = state.get_manager("m", use_cb=False)
    assert isinstance(manager, serving.SpeculativeGenerateManager) and manager.drafting is drafting  # ...drafts
    assert state.get_manager("m", use_cb=False) is manager


def plain_generate(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def tiny_hybrid(directory, tokenizer):
    """A Qwen3.5 text model (gated delta rule + attention layers: continuous batching does not run it) with the
    zoo's tokenizer, saved as safetensors."""
    from test_mtp_checkpoints import qwen_config
    from transformers import AutoModelForCausalLM

    config = qwen_config("qwen3_5_text")
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked: greedy text falls into loops prompt lookup copies
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return hf_specdec.enable(model)


@pytest.mark.parametrize("model_kind", ["zoo", "hybrid"])
def test_one_request_at_a_time_drafts_in_generate_and_equals_plain_generate(model_kind, tmp_path):
    """`continuous_batching=False`: each request is decoded by `generate` with the server's drafter (for a hybrid,
    its recurrent state rolled back after rejections), streamed or not, and answers plain `generate`'s text."""
    target, _, tokenizer = zoo.load_default()
    model_dir = MODEL
    if model_kind == "hybrid":
        target, model_dir = tiny_hybrid(tmp_path, tokenizer), str(tmp_path)
    drafting = {"drafter": "prompt_lookup", "speculative_gamma": 4, "speculative_gamma_policy": "constant"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app, model_manager, state = serving.build_server(
        model_dir, drafting, device="cpu", dtype="float32", continuous_batching=False
    )
    (loaded,) = model_manager.loaded_models.values()
    multi_token = []

    def record(module, args, kwargs, out):
        multi_token.append((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[1] > 1)

    hook = loaded.model.register_forward_hook(record, with_kwargs=True)
    try:
        with run_server(app) as client:
            for prompt in prompts(2):
                expected = plain_generate(target, tokenizer, prompt)
                multi_token.clear()
                response = client.completions.create(
                    model=model_dir, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
                )
                assert response.choices[0].text == expected
                assert any(multi_token[1:]), "no forward after the prefill verified drafts"
                streamed = client.completions.create(
                    model=model_dir, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True
                )
                assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected
        assert isinstance(state.get_manager(model_dir), serving.SpeculativeGenerateManager)
    finally:
        hook.remove()
        state.shutdown()
        model_manager.shutdown()
        torch.set_num_threads(threads)


def test_pickle_only_directories_are_refused(tmp_path):
    target, _, tokenizer = zoo.load_default()
    target.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(target.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        serving.build_server(str(tmp_path), {"drafter": "prompt_lookup"}, device="cpu")


def test_cli_refuses_drafters_continuous_batching_does_not_serve(capsys):
    from hf_specdec.cli import main

    assert main(["serve", "--drafter", "eagle"]) == 2
    assert "--drafter must be one of prompt_lookup, suffix, ngram, model" in capsys.readouterr().err
    assert main(["serve", "./my-model", "--drafter", "model"]) == 2
    assert "--drafter model needs a PATH" in capsys.readouterr().err
    assert main(["serve", "--drafter", "suffix", "somewhere"]) == 2
    assert "takes no path" in capsys.readouterr().err
    assert main(["serve", "./my-model", "--drafter", "ngram"]) == 2
    assert "--drafter ngram needs a PATH" in capsys.readouterr().err
    assert main(["serve", "--no-continuous-batching", "--cb-num-blocks", "8"]) == 2
    assert "--no-continuous-batching serves without a paged cache: drop --cb-num-blocks 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--cb-max-memory-percent", "2"])
    assert "must be a number in (0, 1], got 2.0" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", [[], ["--drafter", "model"]], ids=["default", "draft_model"])
def test_cli_serves_the_embedded_model_over_http(reference, drafter):
    """`hf-specdec serve` as a user runs it (its own process), answering a real HTTP request with plain's text:
    with the default drafter (prompt lookup) and with the embedded draft model."""
    with socket.socket() as probe:  # a free port (released just before the server binds it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "hf_specdec.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--threads", "1", "--cb-num-blocks", "96", "--cb-block-size", "16", "--cb-max-batch-tokens", "256"]
    command += drafter
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "hf-specdec serve did not answer within 120 s"
                time.sleep(0.5)
        prompt = next(iter(reference))
        assert complete(client, prompt) == reference[prompt]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_missing_serving_packages_name_the_install(monkeypatch, capsys):
    from hf_specdec.cli import main

    monkeypatch.setattr(serving, "is_serve_available", lambda: False)
    assert main(["serve"]) == 2
    assert 'pip install "hf-specdec[serve]"' in capsys.readouterr().err
    with pytest.raises(ImportError, match="serving packages"):
        serving.build_server(MODEL, {"drafter": "prompt_lookup"})
