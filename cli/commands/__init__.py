"""One thin module per command (or family), and the options they share. Nothing imports this."""
