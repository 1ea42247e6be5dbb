"""The fixture's training recipe: make_fixture (the entry point), fixture_data, train_target, train_heads,
fixture_card."""
