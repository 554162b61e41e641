"""An OTLP/gRPC trace receiver in this process (opentelemetry-proto's `TraceService`), for
tests and benchmarks of request traces: it keeps every span it is sent."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """`spans`: every span received; `trace(id)`: those of one trace (hex id). `endpoint`
    (host:port) once started; `stop` ends it."""

    def __init__(self, workers: int = 2) -> None:
        self.spans: list = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self._server.start()

    def Export(self, request, context):
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list:
        with self._lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]

    def count(self, name: str) -> int:
        with self._lock:
            return sum(s.name == name for s in self.spans)

    def stop(self) -> None:
        self._server.stop(0)
