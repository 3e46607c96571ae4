"""partition: the model and its slices — model definition and checkpoint loading, ONNX export,
engine build and runners (TensorRT / ONNX Runtime / PyTorch)."""
