"""The RL dialects trainers already speak: vLLM's RL routes (`app.dialects.vllm`) and SGLang's
(`app.dialects.sglang`), each mapped onto rlserve's own services. Generation goes through
`GenerationService`, pauses and weight updates through `WeightsControl` (so they fan out over
replicas and commit all-or-nothing as rlserve's own routes do): no second implementation."""
