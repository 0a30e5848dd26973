"""Reading back: the one reader path, what a directory holds, which checkpoint "last" is, and the ranks agreeing on
it."""
