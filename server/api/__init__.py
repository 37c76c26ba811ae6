"""What every protocol door shares: admission (the door), the request service (pick, reserve,
decode, run, finish), the Open Inference Protocol's tensors, the JSON schemas."""
