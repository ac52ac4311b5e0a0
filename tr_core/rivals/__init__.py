"""The training-free methods the Token Recycling paper compares itself with, on this project's engine: REST
(``rest``) and Lookahead decoding (``lookahead``)."""
