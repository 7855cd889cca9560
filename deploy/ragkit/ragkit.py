"""Shared code of the demo RAG models: real (small) text computation plus drill knobs.

Each model version's `model.py` names one class from here; all subclass `StepModel`, which reads
the `delay_ms` and `error_rate` config parameters so drills can slow a model down or make it fail,
and `alloc_mb`, memory it holds while loaded (a footprint for memory-aware loads to measure).
At runtime, without a reload, `faults.json` beside the repository (`{"reranker": {"delay_ms":
300, "error_rate": 0.1}}`, written by `manage.py devfleet fault`) adds to them, for every
version of the models it names.
"""

import hashlib
import itertools
import json
import random
import re
import threading
import time
from pathlib import Path

import numpy as np

DIMS = 64
STOPWORDS = frozenset(
    (
        "a an and are at be can do does for how i in is it my of on or the to what when where "
        "which who why will with you your"
    ).split()
)
FAQ = json.loads((Path(__file__).parent / "faq.json").read_text())


def tokens(text: str, *, refined: bool) -> list[str]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    if not refined:
        return words
    stems = [re.sub(r"(ing|ed|es|s)$", "", w) if len(w) > 4 else w for w in words]
    kept = [w for w in stems if w not in STOPWORDS]
    return kept + [f"{a}_{b}" for a, b in itertools.pairwise(kept)]


def embed(text: str, *, refined: bool) -> np.ndarray:
    """Hashed bag of words, L2-normalized: texts sharing words get a high cosine similarity."""
    vector = np.zeros(DIMS, dtype=np.float32)
    for word in tokens(text, refined=refined):
        digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
        index = int.from_bytes(digest, "little")
        vector[index % DIMS] += 1.0 if index & (1 << 31) else -1.0
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm else vector


def retrieve(
    query: np.ndarray, *, refined: bool, k: int, documents: list[dict] = FAQ
) -> list[dict]:
    scored = [
        {
            **entry,
            "score": float(np.dot(query, embed(entry["q"] + " " + entry["a"], refined=refined))),
        }
        for entry in documents
    ]
    return sorted(scored, key=lambda entry: entry["score"], reverse=True)[:k]


def rerank(question: str, candidates: list[dict], *, refined: bool) -> list[dict]:
    """Word overlap of the question with each candidate's FAQ question, blended with retrieval."""
    asked = set(tokens(question, refined=refined))
    ranked = []
    for candidate in candidates:
        known = set(tokens(candidate["q"], refined=refined))
        overlap = len(asked & known) / (len(asked | known) or 1)
        ranked.append({**candidate, "score": 0.7 * overlap + 0.3 * candidate["score"]})
    return sorted(ranked, key=lambda entry: entry["score"], reverse=True)


def generate(question: str, contexts: list[dict], *, friendly: bool) -> tuple[str, str]:
    best = contexts[0]
    source = f"faq:{best['id']}"
    if not friendly:
        return best["a"], source
    if best["score"] < 0.15:
        return f"I am not sure I understood. The closest help article says: {best['a']}", source
    return f"{best['a']} Anything else I can help with?", source


def encode(items: list[dict]) -> np.ndarray:
    return np.array([json.dumps(item).encode() for item in items], dtype=np.object_)


def decode(row: np.ndarray) -> list[dict]:
    return [json.loads(item) for item in row]


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# Beside the repository the model was loaded from (not resolved: the demo links ragkit in).
FAULTS = Path(__file__).absolute().parent.parent / "faults.json"


class Faults:
    """The runtime knob: `faults.json` read again whenever it changes (a stat a request)."""

    def __init__(self) -> None:
        self.seen: tuple[int, int, int] | None = None
        self.by_model: dict[str, dict[str, float]] = {}

    def of(self, model: str) -> tuple[float, float]:
        """(added delay in seconds, added error rate) for `model` now."""
        try:
            stat = FAULTS.stat()
            # Each write replaces the file: a new inode, even within one tick of a coarse clock.
            changed = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
        except FileNotFoundError:
            self.seen, self.by_model = None, {}
            return 0.0, 0.0
        if changed != self.seen:
            try:
                self.by_model, self.seen = json.loads(FAULTS.read_text()), changed
            except ValueError:  # caught half-written: read it again at the next request
                return 0.0, 0.0
        fault = self.by_model.get(model, {})
        return float(fault.get("delay_ms", 0)) / 1000, float(fault.get("error_rate", 0))


class StepModel:
    """Runs `infer` per request; `delay_ms` and `error_rate` come from the model config, and
    from the runtime knob (Faults) on top."""

    inputs: tuple[str, ...] = ()

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = config.get("name", "")
        self.faults = Faults()
        parameters = config.get("parameters", {})
        self.delay_s = float(parameters.get("delay_ms", {}).get("string_value", "0")) / 1000
        self.error_rate = float(parameters.get("error_rate", {}).get("string_value", "0"))
        held = float(parameters.get("alloc_mb", {}).get("string_value", "0"))
        self.ballast = np.ones(int(held * 2**20), dtype=np.uint8)  # written: really resident

    def execute(self, requests: list) -> list:
        import triton_python_backend_utils as pb_utils  # only importable inside Triton's stub

        responses = []
        delay_s, error_rate = self.faults.of(self.name)
        delay_s, error_rate = delay_s + self.delay_s, error_rate + self.error_rate
        for request in requests:
            if delay_s:
                time.sleep(delay_s)
            if random.random() < error_rate:
                error = pb_utils.TritonError(f"injected failure (error_rate={error_rate})")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            arrays = {
                name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in self.inputs
            }
            outputs = self.infer_batch(arrays)
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def infer_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = len(next(iter(arrays.values())))
        rows = [self.infer({name: a[i] for name, a in arrays.items()}) for i in range(batch)]
        return {name: np.stack([row[name] for row in rows]) for name in rows[0]}

    def infer(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError


class Embedder(StepModel):
    inputs = ("QUESTION",)
    refined = False

    def infer(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"EMBEDDING": embed(text(row["QUESTION"][0]), refined=self.refined)}


class Retriever(StepModel):
    inputs = ("EMBEDDING",)
    refined = False
    k = 4

    documents = FAQ  # the knowledge base its index was built from

    def infer(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        found = retrieve(row["EMBEDDING"], refined=self.refined, k=self.k, documents=self.documents)
        return {"CANDIDATES": encode(found)}


class Reranker(StepModel):
    inputs = ("QUESTION", "CANDIDATES")
    refined = False
    slow_s = 0.0
    worst_first = False

    def infer(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(self.slow_s)
        ranked = rerank(text(row["QUESTION"][0]), decode(row["CANDIDATES"]), refined=self.refined)
        if self.worst_first:
            ranked.reverse()
        scores = np.array([entry["score"] for entry in ranked], dtype=np.float32)
        return {"RANKED": encode(ranked), "SCORES": scores}


class Generator(StepModel):
    inputs = ("QUESTION", "CONTEXTS")
    friendly = False

    def infer(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        answer, source = generate(
            text(row["QUESTION"][0]), decode(row["CONTEXTS"]), friendly=self.friendly
        )
        return {
            "ANSWER": np.array([answer.encode()], dtype=np.object_),
            "SOURCE": np.array([source.encode()], dtype=np.object_),
        }


# The versions the demo repository ships: each `<model>/<version>/model.py` names one of these.
class EmbedderV1(Embedder):
    pass


class EmbedderV2(Embedder):
    refined = True


class RetrieverV1(Retriever):
    pass


class RetrieverV2(Retriever):
    refined = True
    k = 6


class RetrieverV3(RetrieverV1):
    """The knowledge base re-indexed, as it should be: a blue-green release for drills."""

    k = 5


class RetrieverV4(RetrieverV1):
    """An index rebuilt from the wrong documents, each article filed under its neighbour's id:
    as fast as v1, and every source it gives is wrong."""

    documents = [{**entry, "id": FAQ[n - 1]["id"]} for n, entry in enumerate(FAQ)]


class RerankerV1(Reranker):
    pass


class RerankerV2(Reranker):
    refined = True


class RerankerV3(RerankerV2):
    """Deliberately slow, for rollback drills: a canary that must lose on P99."""

    slow_s = 0.25


class RerankerV6(RerankerV2):
    """Fast but wrong, for quality drills: as quick as v2, with the worst passage first."""

    worst_first = True


class GeneratorV1(Generator):
    pass


class GeneratorV2(Generator):
    friendly = True


class Llm(StepModel):
    """The pipeline's LLM step, decoupled as Triton's vLLM and TensorRT-LLM backends are: it
    reads a prompt (the question and the ranked passages), waits a prompt time that grows with
    the prompt, then streams the answer one token per response, a time per output token apart,
    at most `max_tokens` of them (the config's, or the request's parameter when lower). At most
    `slots` requests stream at once, as an engine's KV cache bounds them; the rest wait.
    It exports the meanings an LLM backend exports under vLLM's names, labelled with the model
    and the version (Triton adds no labels to custom metrics), so that a canary's series stand
    beside the baseline's."""

    prefill_s = 0.060  # prompt time: a fixed part ...
    prefill_per_token_s = 0.0004  # ... and one per prompt token
    per_token_s = 0.006  # time per output token
    slots = 8
    elaborate = False  # the answer said twice: a release whose answers are twice as long

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # only importable inside Triton's stub

        super().initialize(args)
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.max_tokens = int(parameters.get("max_tokens", {}).get("string_value", "256"))
        self.free = threading.BoundedSemaphore(self.slots)
        # One call into Triton at a time: the stub's messages to the server are not safe from
        # several threads at once (the server crashed, libtriton_python.so, under 16 streams).
        self.backend = threading.Lock()
        self.streams: set[threading.Thread] = set()
        labels = {"model": self.name, "version": args["model_version"]}
        kinds = pb_utils.MetricFamily
        # Families outlive their metrics (Triton deletes a metric with its family).
        self.families = [
            kinds(f"vllm:{name}", about, kind)
            for name, about, kind in [
                ("time_to_first_token_seconds", "Time to first token", kinds.HISTOGRAM),
                ("time_per_output_token_seconds", "Time per output token", kinds.HISTOGRAM),
                ("generation_tokens_total", "Output tokens", kinds.COUNTER),
                ("prompt_tokens_total", "Prompt tokens", kinds.COUNTER),
                ("num_requests_waiting", "Requests waiting for a slot", kinds.GAUGE),
            ]
        ]
        first, per_token, generated, prompted, waiting = self.families
        self.first_token = first.Metric(labels=labels, buckets=FIRST_TOKEN_BUCKETS)
        self.per_token = per_token.Metric(labels=labels, buckets=PER_TOKEN_BUCKETS)
        self.generated = generated.Metric(labels=labels)
        self.prompted = prompted.Metric(labels=labels)
        self.waiting = waiting.Metric(labels=labels)

    def execute(self, requests: list) -> None:
        """Each request streams on its own thread, as a continuous-batching engine interleaves
        them: a long answer does not hold the next request's first token back."""
        self.streams = {thread for thread in self.streams if thread.is_alive()}
        for request in requests:
            thread = threading.Thread(target=self.stream, args=(request, time.monotonic()))
            self.streams.add(thread)
            thread.start()

    def finalize(self) -> None:
        """An unload finishes the open streams first."""
        for thread in list(self.streams):
            thread.join()

    def stream(self, request, arrived: float) -> None:
        import triton_python_backend_utils as pb_utils

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        delay_s, error_rate = self.faults.of(self.name)
        if random.random() < error_rate + self.error_rate:
            error = pb_utils.TritonError(f"injected failure (error_rate={error_rate})")
            with self.backend:
                sender.send(pb_utils.InferenceResponse(error=error), flags=final)
            return
        question = text(pb_utils.get_input_tensor_by_name(request, "QUESTION").as_numpy()[0][0])
        contexts = decode(pb_utils.get_input_tensor_by_name(request, "CONTEXTS").as_numpy()[0])
        asked = json.loads(request.parameters() or "{}").get("max_tokens", self.max_tokens)
        answer, source = generate(question, contexts, friendly=True)
        if self.elaborate:
            answer = f"{answer} To say it once more: {answer}"
        prompt = len(question.split()) + sum(len(c["a"].split()) for c in contexts)
        words = answer.split(" ")[: min(int(asked), self.max_tokens)]
        cited = pb_utils.Tensor("SOURCE", np.array([[source.encode()]], dtype=np.object_))
        with self.backend:
            self.waiting.increment(1)
        with self.free:
            with self.backend:
                self.waiting.increment(-1)
            time.sleep(delay_s + self.delay_s + self.prefill_s + self.prefill_per_token_s * prompt)
            with self.backend:
                self.prompted.increment(prompt)
                self.first_token.observe(time.monotonic() - arrived)
            for n, word in enumerate(words):
                if n:
                    before = time.monotonic()
                    time.sleep(self.per_token_s)
                    with self.backend:
                        self.per_token.observe(time.monotonic() - before)
                piece = np.array([[(f" {word}" if n else word).encode()]], dtype=np.object_)
                token = pb_utils.Tensor("ANSWER", piece)
                with self.backend:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[token, cited]))
            with self.backend:
                self.generated.increment(len(words))
                sender.send(flags=final)


# vLLM's own buckets for its two histograms
FIRST_TOKEN_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
PER_TOKEN_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4]


class LlmV1(Llm):
    pass


class LlmV2(Llm):
    """A healthy release: the same speed and answers."""


class LlmV3(Llm):
    """Its first token twice as slow at the same total time for a typical answer (22 tokens):
    what users feel first got worse, and whole-request latency does not show it."""

    prefill_s = Llm.prefill_s * 2 + 0.040  # the prompt part doubled too (about 40 ms)
    per_token_s = Llm.per_token_s - 0.100 / 21


class LlmV4(Llm):
    """Answers twice as long at the same speed per token."""

    elaborate = True


class LlmV5(Llm):
    """A lighter, faster LLM: the streaming chain's degradation tier."""

    prefill_s = Llm.prefill_s / 3
    prefill_per_token_s = Llm.prefill_per_token_s / 3
    per_token_s = Llm.per_token_s / 3
