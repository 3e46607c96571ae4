"""GGUF model files (llama.cpp / Ollama). folder: `--model` values (a .gguf file, an alias) as model folders,
torch- and numpy-free; reader: the header as a ModelConfig; tensors (+ quants): the weights as the one model
definition with block-quantised projections kept as codes; tokenizer: the tokenizer from the vocabulary.
Import the submodule you need: this package's import stays light, for the torch-free half."""
