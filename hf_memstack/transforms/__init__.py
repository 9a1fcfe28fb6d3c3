"""What ``prepare_model`` applies to a model, one transformation per module, each with its check
(may fail, touches nothing), its apply (cannot fail on checked input) and its verify piece."""
