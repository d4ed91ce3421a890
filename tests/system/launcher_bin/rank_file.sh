#!/bin/sh
# A binary worker (--no-python): touches $1/$RANK.
echo "creating $1/$RANK"
touch "$1/$RANK"
