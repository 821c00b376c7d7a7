"""Run logs: metrics.jsonl, TensorBoard, markdown logs, progress."""
