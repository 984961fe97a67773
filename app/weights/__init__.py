"""The weights core: what a weight update is made of, below the engines and above nothing of
theirs. Checkpoint layouts and files (`checkpoint`), LoRA adapters and PEFT's layout (`lora`,
`lora_layout`), staging of received tensors (`staging`), the server side of the collective
transfer and its transports (`transfer_engine`, `transport`), and checkpoints shipped between
replicas (`shipment`). The engines (`app.engine`) build on it; the updates a server takes
(`app.updates`) drive both."""
