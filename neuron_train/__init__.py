"""neuron_train: XLA-native training of vision models on AWS Trainium / Inferentia2."""

__version__ = "0.1.0"
