"""The only module that talks to Triton: its HTTP/REST protocol through tritonclient, and gRPC
for what only gRPC serves, a decoupled model's stream of responses.

Every call has a timeout. Errors become `TritonUnreachable` (transient: the node did not answer) or
`TritonRejected` (Triton answered with an error; its text is kept verbatim for the operator).
"""

import queue
import random
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import gevent
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from django.conf import settings
from geventhttpclient import HTTPParseError
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

from apps.fleet import addresses


class TritonError(Exception):
    def __init__(self, node: str, message: str) -> None:
        self.node, self.message = node, message
        super().__init__(f"{node}: {message}")


class TritonUnreachable(TritonError):
    """Connection refused, reset or timed out: worth retrying."""


class TritonTimeout(TritonUnreachable):
    """No answer in time: the request may have reached the node and may still be in progress."""


class TritonDropped(TritonTimeout):
    """The connection closed before an answer (the node crashed, say): the request may have
    reached the node too."""


class TritonRejected(TritonError):
    """Triton answered with an error (bad config, unknown model...): retrying will not help."""


@dataclass(frozen=True)
class IndexEntry:
    model: str
    version: int | None
    state: str
    reason: str


def ready_in(index: Iterable[IndexEntry | dict[str, Any]]) -> dict[str, set[int]]:
    """Model -> its versions READY in a repository index, as read or as a node stores it."""
    found: dict[str, set[int]] = {}
    for entry in index:
        read = entry if isinstance(entry, dict) else asdict(entry)
        if read.get("state") == "READY" and read.get("version") not in (None, ""):
            found.setdefault(read["model"], set()).add(int(read["version"]))
    return found


@dataclass(frozen=True)
class ServerMetadata:
    version: str
    extensions: list[str]


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a Triton tensor datatype (FP32, INT64, BYTES...)."""
    return np.dtype(triton_to_np_dtype(datatype))


def sample_inputs(
    spec: list[tuple[str, str, list[int]]], rng: random.Random, *, texts: Sequence[str]
) -> dict[str, np.ndarray]:
    """One request's inputs (batch of 1) from the model's metadata (`model_inputs`): strings
    get one of `texts`, numbers noise."""
    inputs = {}
    for name, datatype, shape in spec:
        dims = [1 if d < 0 else d for d in shape]
        dims[0] = 1  # batch dimension (or a variable first dimension)
        if datatype == "BYTES":
            inputs[name] = np.full(dims, rng.choice(texts).encode(), dtype=np.object_)
        else:
            noise = np.random.default_rng(rng.randrange(2**32)).random(dims)
            inputs[name] = noise.astype(numpy_dtype(datatype))
    return inputs


def tensors_json(inputs: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """A request's inputs in the form Triton's JSON protocol gives them (datatype, shape, data
    flattened), strings as text: to be stored, and sent again as they were (`tensors_from`)."""
    return {
        name: {
            "datatype": np_to_triton_dtype(array.dtype),
            "shape": list(array.shape),
            "data": [v.decode() if isinstance(v, bytes) else v for v in array.flatten().tolist()],
        }
        for name, array in inputs.items()
    }


def tensors_from(stored: dict[str, dict[str, Any]]) -> dict[str, np.ndarray]:
    """`tensors_json` back to the arrays it was made of."""
    found = {}
    for name, tensor in stored.items():
        if tensor["datatype"] == "BYTES":
            data = np.array([str(v).encode() for v in tensor["data"]], dtype=np.object_)
        else:
            data = np.array(tensor["data"], dtype=numpy_dtype(tensor["datatype"]))
        found[name] = data.reshape(tensor["shape"])
    return found


def _connect_to(client: httpclient.InferenceServerClient, address: str) -> None:
    """Make `client` connect to `address`, the one addresses.pinned checked, instead of
    resolving the node's name again; the Host header and TLS (SNI, the certificate's name)
    still use the name. tritonclient has no option for it: its geventhttpclient pool resolves
    `_connection_host` at each connection (through gevent's resolver, a thread pool: a hand-off
    to another thread for every call), and is given the address, already resolved."""
    pool = client._client_stub._connection_pool
    if not isinstance(getattr(pool, "_connection_host", None), str):
        raise RuntimeError("geventhttpclient changed: cannot pin the node's address")
    pool._connection_host = address
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    resolved = [
        (family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, pool._connection_port))
    ]
    pool._resolve = lambda: resolved


# What Triton's HTTP endpoint answers a request for a decoupled model (http_server.cc).
DECOUPLED = "doesn't support models with decoupled transaction policy"


@dataclass(frozen=True)
class Reply:
    """What a model answered: every output; a stream's pieces joined (`joined`), with the time
    from sending to its first response and how many responses carried outputs."""

    outputs: dict[str, np.ndarray]
    first_ms: float | None = None  # a stream's only
    responses: int = 1


class TritonClient:
    def __init__(
        self, http_url: str, *, node: str = "", timeout: float | None = None, grpc: str = ""
    ) -> None:
        """`grpc`: the node's gRPC endpoint (host:port), where it streams decoupled answers."""
        parts = urlsplit(http_url)
        self.address, self.host = parts.netloc, parts.hostname or ""
        self.secure = parts.scheme == "https"
        self.grpc = grpc
        self.node = node or self.address
        self.timeout = timeout if timeout is not None else settings.TRITON_TIMEOUT_S

    @classmethod
    def of(cls, node: Any) -> "TritonClient":
        """The client of a registered node (apps.fleet.models.Node)."""
        return cls(node.http_url, node=node.name, grpc=node.grpc_url)

    def _open(self, timeout: float | None = None) -> httpclient.InferenceServerClient:
        # Checked on every connection, not only when the URL was saved: DNS may have changed.
        try:
            pinned = addresses.pinned(self.host)
        except addresses.Refused as exc:
            raise TritonRejected(self.node, str(exc)) from None
        client = httpclient.InferenceServerClient(
            self.address,
            connection_timeout=min(self.timeout, 5.0),
            network_timeout=timeout or self.timeout,
            # https: certificates checked against TRITON_CA_BUNDLE, else certifi's authorities.
            ssl=self.secure,
            ssl_options={"ca_certs": settings.TRITON_CA_BUNDLE}
            if settings.TRITON_CA_BUNDLE
            else None,
        )
        _connect_to(client, pinned)
        return client

    @contextmanager
    def _mapped(self) -> Iterator[None]:
        try:
            yield
        except InferenceServerException as exc:
            raise TritonRejected(self.node, exc.message() or str(exc)) from exc
        except (TimeoutError, gevent.Timeout) as exc:
            raise TritonTimeout(self.node, f"{type(exc).__name__}: {exc}") from exc
        except HTTPParseError as exc:
            raise TritonDropped(self.node, f"{type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise TritonUnreachable(self.node, f"{type(exc).__name__}: {exc}") from exc

    @contextmanager
    def _client(self, timeout: float | None = None) -> Iterator[httpclient.InferenceServerClient]:
        with self._mapped():
            client = self._open(timeout)
            try:
                yield client
            finally:
                client.close()

    def health(self) -> str:
        """'ready' or 'live' (up, but some model failed or the server is still starting)."""
        with self._client() as client:
            live = client.is_server_live()
            return "ready" if live and client.is_server_ready() else "live"

    def server_metadata(self) -> ServerMetadata:
        with self._client() as client:
            data = client.get_server_metadata()
        return ServerMetadata(version=data["version"], extensions=list(data.get("extensions", [])))

    def repository_index(self) -> list[IndexEntry]:
        with self._client() as client:
            rows = client.get_model_repository_index(headers=settings.TRITON_REPOSITORY_HEADER)
        return [
            IndexEntry(
                model=row["name"],
                version=int(row["version"]) if row.get("version") else None,
                state=row.get("state", ""),
                reason=row.get("reason", ""),
            )
            for row in rows
        ]

    def load(self, model: str, *, config_json: str | None = None) -> None:
        """Load or reload `model`; returns once Triton is done (callers read the index back)."""
        # Loading a model runs its initialize(): far slower than any other repository call.
        with self._client(settings.FLEET_LOAD_TIMEOUT_S) as client:
            client.load_model(model, config=config_json, headers=settings.TRITON_REPOSITORY_HEADER)

    def version_ready(self, model: str, version: int) -> bool:
        """Whether Triton serves `version` of `model` now (asked of the model, not the index)."""
        with self._client() as client:
            return bool(client.is_model_ready(model, str(version)))

    def unload(self, model: str, *, unload_dependents: bool = False) -> None:
        with self._client() as client:
            client.unload_model(
                model,
                unload_dependents=unload_dependents,
                headers=settings.TRITON_REPOSITORY_HEADER,
            )

    def model_config(self, model: str) -> dict[str, Any]:
        """The config Triton runs `model` with, as JSON (auto-completed fields included)."""
        with self._client() as client:
            return dict(client.get_model_config(model))

    def memory_usage(self, model: str, version: int) -> dict[str, int]:
        """The bytes the loaded version holds by kind of memory (GPU, CPU, CPU_PINNED), as its
        backend reports them (statistics extension); empty where the backend does not."""
        with self._client() as client:
            stats = client.get_inference_statistics(model, str(version))
        found: dict[str, int] = {}
        for row in stats.get("model_stats", []):
            for usage in row.get("memory_usage", []):
                found[usage["type"]] = found.get(usage["type"], 0) + int(usage["byte_size"])
        return found

    def model_inputs(self, model: str) -> list[tuple[str, str, list[int]]]:
        """(name, datatype, shape) of each input of the loaded `model`."""
        with self._client() as client:
            metadata = client.get_model_metadata(model)
        return [
            (i["name"], i["datatype"], [int(d) for d in i["shape"]]) for i in metadata["inputs"]
        ]

    def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One inference; every input carries its batch dimension. Returns every output."""
        with self.session() as session:
            return session.infer(model, inputs)

    @contextmanager
    def session(self, timeout: float | None = None) -> Iterator["Session"]:
        """Many inferences over one connection, from one thread: evaluations send hundreds."""
        session = Session(self, timeout)
        try:
            yield session
        finally:
            session.close()


class Session:
    """Many inferences from one thread, over one connection per protocol, opened on first use:
    HTTP, and gRPC with one stream for a model that answers with a stream (decoupled), which
    Triton's HTTP endpoint refuses."""

    def __init__(self, owner: TritonClient, timeout: float | None) -> None:
        self.owner, self.timeout = owner, timeout
        self._client: httpclient.InferenceServerClient | None = None
        self._grpc: grpcclient.InferenceServerClient | None = None
        self._responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._streamed: set[str] = set()  # models answered over gRPC

    def infer(
        self, model: str, inputs: dict[str, np.ndarray], *, version: int | None = None
    ) -> dict[str, np.ndarray]:
        """One inference, of `version` exactly when given; every input carries its batch
        dimension. Returns every output (a stream's joined)."""
        return self.reply(model, inputs, version=version).outputs

    def reply(
        self, model: str, inputs: dict[str, np.ndarray], *, version: int | None = None
    ) -> Reply:
        if model in self._streamed:
            return self._stream(model, inputs, version)
        tensors = []
        for name, array in inputs.items():
            tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        try:
            with self.owner._mapped():
                try:
                    result = self._http().infer(
                        model, tensors, model_version=str(version) if version else ""
                    )
                except (TimeoutError, gevent.Timeout, HTTPParseError, OSError):
                    self.close()  # the connection may hold half an answer: the next opens anew
                    raise
        except TritonRejected as exc:
            if DECOUPLED not in exc.message:
                raise
            # Refused before it reached the model; over gRPC from now on, which answers any
            # model (a balancer's nodes may serve one version decoupled and another not).
            self._streamed.add(model)
            return self._stream(model, inputs, version)
        outputs = result.get_response()["outputs"]
        return Reply({out["name"]: result.as_numpy(out["name"]) for out in outputs})

    def _http(self) -> httpclient.InferenceServerClient:
        if self._client is None:
            self._client = self.owner._open(self.timeout)
        return self._client

    def _stream(self, model: str, inputs: dict[str, np.ndarray], version: int | None) -> Reply:
        node = self.owner.node
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        waited = self.timeout if self.timeout is not None else self.owner.timeout
        sent = time.perf_counter()
        try:
            self._stream_open().async_stream_infer(
                model,
                tensors,
                model_version=str(version) if version else "",
                enable_empty_final_response=True,
            )
        except InferenceServerException as exc:
            self.close()
            raise _grpc_error(node, exc) from exc
        pieces: dict[str, list[np.ndarray]] = {}
        first_ms, responses = None, 0
        while True:
            try:
                result, error = self._responses.get(
                    timeout=max(0.0, sent + waited - time.perf_counter())
                )
            except queue.Empty:
                self.close()  # its responses may still come: the next request opens anew
                raise TritonTimeout(node, f"no whole answer within {waited:g} s") from None
            if error is not None:
                self.close()
                raise _grpc_error(node, error)
            response = result.get_response()
            for out in response.outputs:
                pieces.setdefault(out.name, []).append(result.as_numpy(out.name))
            if response.outputs:
                responses += 1
                first_ms = first_ms or (time.perf_counter() - sent) * 1000
            if response.parameters["triton_final_response"].bool_param:
                break
        return Reply({name: joined(arrays) for name, arrays in pieces.items()}, first_ms, responses)

    def _stream_open(self) -> grpcclient.InferenceServerClient:
        owner = self.owner
        if self._grpc is not None:
            return self._grpc
        if not owner.grpc:
            raise TritonRejected(
                owner.node,
                "the model answers with a stream, which Triton serves over gRPC only, and no "
                "gRPC address is known for this node",
            )
        host, _, port = owner.grpc.rpartition(":")
        try:
            pinned = addresses.pinned(host.strip("[]"))
        except addresses.Refused as exc:
            raise TritonRejected(owner.node, str(exc)) from None
        target = f"[{pinned}]:{port}" if ":" in pinned else f"{pinned}:{port}"
        client = grpcclient.InferenceServerClient(
            target,
            ssl=owner.secure,
            root_certificates=settings.TRITON_CA_BUNDLE or None,
            channel_args=[("grpc.ssl_target_name_override", host)] if owner.secure else None,
        )
        client.start_stream(
            callback=lambda result, error: self._responses.put((result, error)),
            stream_timeout=None,
        )
        self._grpc = client
        return client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._grpc is not None:
            self._grpc.stop_stream(cancel_requests=True)
            self._grpc.close()
            self._grpc = None
            self._responses = queue.Queue()  # a cancelled stream's late responses go nowhere


def joined(pieces: list[np.ndarray]) -> np.ndarray:
    """A streamed output whole: a text's pieces one after the other, an output that every
    response repeats (a source, say) once, any other output its last value."""
    last = pieces[-1]
    if last.dtype != np.object_ or all(np.array_equal(p, last) for p in pieces):
        return last
    whole = pieces[0]
    for piece in pieces[1:]:
        whole = whole + piece  # bytes, element by element
    return whole


def _grpc_error(node: str, exc: InferenceServerException) -> TritonError:
    if (exc.status() or "") in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"):
        return TritonUnreachable(node, exc.message() or str(exc))
    return TritonRejected(node, exc.message() or str(exc))
