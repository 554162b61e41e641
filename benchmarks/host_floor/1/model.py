"""Triton's floor for `make bench-host`: a bare decoupled Python model that does nothing but
send each open request its `max_tokens` one-token responses, round robin over the open
requests, from one thread. No engine, no metrics: what the stub and tritonserver cost per
response, the most any Python-backend model can send here."""
import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

TOKEN = np.array([b" fox"], dtype=np.object_)
ONE = np.array([1], dtype=np.uint32)


class TritonPythonModel:
    def initialize(self, args):
        self._new = queue.Queue()
        threading.Thread(target=self._send_round_robin, daemon=True).start()

    def execute(self, requests):
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
            params = json.loads(raw.as_numpy().reshape(-1)[0]) if raw is not None else {}
            self._new.put([request.get_response_sender(), int(params.get("max_tokens", 16))])
        return None

    def _send_round_robin(self):
        open_streams = []
        while True:
            if not open_streams:
                open_streams.append(self._new.get())
            while not self._new.empty():
                open_streams.append(self._new.get_nowait())
            for stream in open_streams:
                sender, left = stream
                stream[1] = left - 1
                response = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", TOKEN), pb_utils.Tensor("num_output_tokens", ONE)])
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if left == 1 else 0)
            open_streams = [s for s in open_streams if s[1] > 0]
