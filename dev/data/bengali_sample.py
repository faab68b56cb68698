#!/usr/bin/env python3
"""A small Bengali + English corpus, assembled offline from the translations Debian ships.

    python3 dev/data/bengali_sample.py OUT_DIR [--locale_dir /usr/share/locale]

Reads every gettext catalogue (.mo) of the Bengali locales (bn, bn_BD, bn_IN) under --locale_dir:
the translations of the installed programs (iso-codes' country, language and currency names,
GLib, GTK, PAM, ...), each an English string and its Bengali translation: real Bengali script
with conjuncts, nukta, the danda and Bengali digits, beside the English it translates. Writes
OUT_DIR/corpus.txt: documents separated by blank lines (prepare_text.py --sep blank), each 16
entries of a catalogue, every entry its English line then its Bengali line; and
OUT_DIR/SOURCES.txt: every catalogue read, the Debian package it comes from and that package's
copyright file, whose licence covers the text (GPL / LGPL for most: use the corpus for local tests
and examples, do not redistribute it without the packages' terms).

More text comes with more packages (`apt-get install iso-codes libglib2.0-data libgtk2.0-common`
is what CI installs; desktop packages bring more catalogues). A real Bengali corpus for training
is a download (docs/INTEROP.md: "Bengali text").
"""
import argparse
import glob
import os
import struct
import subprocess
import sys

ENTRIES_PER_DOCUMENT = 16


def read_mo(path):
    """The (msgid, msgstr) pairs of a gettext .mo file (GNU format: magic, revision, count, the offsets
    of the original and translated string tables), without the header entry; plural forms keep
    their first form."""
    data = open(path, "rb").read()
    if len(data) < 20:
        raise ValueError("shorter than the .mo header")
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if order is None:
        raise ValueError(f"not a gettext .mo file (magic {magic:#x})")
    _, n, orig_at, trans_at = struct.unpack(order + "4I", data[4:20])

    def string(table, k):
        length, offset = struct.unpack(order + "2I", data[table + 8 * k:table + 8 * k + 8])
        if offset + length > len(data):
            raise ValueError(f"string {k} runs past the end of the file")
        return data[offset:offset + length]

    pairs = []
    for k in range(n):
        msgid, msgstr = string(orig_at, k), string(trans_at, k)
        if not msgid:
            continue  # the catalogue's header
        msgid = msgid.split(b"\x04")[-1].split(b"\0")[0]  # (a context before \x04; plurals after \0)
        msgstr = msgstr.split(b"\0")[0]
        try:
            en, bn = msgid.decode("utf-8").strip(), msgstr.decode("utf-8").strip()
        except UnicodeDecodeError:
            continue  # (a catalogue in another encoding: rare, skipped)
        if en and bn and en != bn:
            pairs.append((en, bn))
    return pairs


def package_of(path):
    try:
        out = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, timeout=30).stdout
        return out.split(":")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--locale_dir", default="/usr/share/locale")
    args = ap.parse_args()
    files = sorted(p for loc in ("bn", "bn_BD", "bn_IN")
                   for p in glob.glob(os.path.join(args.locale_dir, loc, "LC_MESSAGES", "*.mo")))
    if not files:
        sys.exit(f"bengali_sample.py: no Bengali catalogues under {args.locale_dir}/bn*/LC_MESSAGES "
                 "(apt-get install iso-codes libglib2.0-data libgtk2.0-common)")
    docs, sources, seen = [], [], set()
    for path in files:
        try:
            pairs = read_mo(path)
        except (OSError, ValueError) as e:
            print(f"bengali_sample.py: skipping {path}: {e}", file=sys.stderr)
            continue
        pairs = [p for p in pairs if p not in seen and not seen.add(p)]  # (bn and bn_IN share many)
        for k in range(0, len(pairs), ENTRIES_PER_DOCUMENT):
            docs.append("\n".join(f"{en}\n{bn}" for en, bn in pairs[k:k + ENTRIES_PER_DOCUMENT]))
        pkg = package_of(path)
        sources.append(f"{path}\t{len(pairs)} entries\t{pkg}\t/usr/share/doc/{pkg}/copyright")
    text = "\n\n".join(d.replace("\n\n", "\n") for d in docs) + "\n"
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "corpus.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(args.out_dir, "SOURCES.txt"), "w", encoding="utf-8") as f:
        f.write("# catalogue\tentries\tDebian package\tits licence (the text is the package's, under its terms)\n")
        f.write("\n".join(sources) + "\n")
    bengali = sum(1 for c in text if "\u0980" <= c <= "\u09ff")
    print(f"bengali_sample.py: {len(docs)} documents from {len(sources)} catalogues, {len(text.encode())} bytes "
          f"({bengali} Bengali characters) -> {args.out_dir}/corpus.txt (sources and licences: SOURCES.txt)")


if __name__ == "__main__":
    main()
