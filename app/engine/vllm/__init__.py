"""The vLLM backend: vLLM's async engine (`backend`) and the code that runs in its worker
processes (`worker`)."""
