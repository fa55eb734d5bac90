"""``tandem train``: training the demo target, draft and MTP head."""
