"""What the launcher reads and removes in a job's checkpoint directory, without TensorFlow.

Before it restarts a job, the launcher names the newest checkpoint's step
(:func:`newest_checkpoint_step`) and removes what the saves that the failure
interrupted left behind (:func:`remove_save_temporaries`). Both read names
and ``checkpoint`` state files as text: the launcher never loads TensorFlow.

A save ``Saver.save(sess, "<dir>/<prefix>", global_step=<step>)`` writes its
files under temporary names and renames them when they are complete, on TF
1.15 and 2.x alike; a killed save leaves them:

- ``<prefix>-<step>.index.tempstate<digits>`` and
  ``<prefix>-<step>.data-00000-of-00001.tempstate<digits>``: the bundle
  writer's two files (TensorFlow's C++ ``BundleWriter``, a random 64-bit
  number in decimal);
- ``<prefix>-<step>.meta.tmp<32 hex>`` and ``checkpoint.tmp<32 hex>``: the
  meta graph and the state file, written by
  ``file_io.atomic_write_string_to_file`` (``uuid4().hex``);
- ``<prefix>-<step>_temp/`` (TF 2.x) or ``<prefix>-<step>_temp_<32 hex>/``
  (TF 1.15): a sharded save's directory (``Saver(sharded=True)``, as
  ``MonitoredTrainingSession`` makes), holding only
  ``part-<i>-of-<n>.index`` and ``part-<i>-of-<n>.data-00000-of-00001``
  files, each perhaps still ``.tempstate<digits>``; the save merges them
  into ``<prefix>-<step>`` and removes the directory.

Without ``global_step`` the names have no ``-<step>``. Only these names of
the job's own prefix count, in the checkpoint directory and in its
``shard-<r>-of-<P>/`` directories (the layout of ``gradaccum.layout``, where
each worker of a ``ShardedAllReduce`` job saves); no other directory is
entered, so another job's files, and files that merely look temporary, stay.

This module does not use TensorFlow and creates no variables or collections.
"""
import os
import re

from gradaccum.distributed.layout import SHARD_PATTERN, list_shards

_STATE_PATH = re.compile(r'^(?:all_)?model_checkpoint_paths?: "(.*)"$', re.M)
# What a sharded save's directory holds: its parts, complete or not yet renamed.
_SHARDED_PART = re.compile(r"^part-\d+-of-\d+\.(?:index|data-\d+-of-\d+)(?:\.tempstate\d+)?$")
_STATE_TEMPORARY = re.compile(r"^checkpoint\.tmp[0-9a-f]{32}$")


def _state_paths(directory):
    """The checkpoint paths the ``checkpoint`` state file of ``directory`` lists (read as text)."""
    try:
        with open(os.path.join(directory, "checkpoint")) as handle:
            return _STATE_PATH.findall(handle.read())
    except (OSError, UnicodeDecodeError):
        return []


def _state_steps(directory):
    """The global steps the ``checkpoint`` state file of ``directory`` lists."""
    return set(int(match.group(1)) for match in (re.search(r"-(\d+)$", path) for path in _state_paths(directory))
               if match)


def newest_checkpoint_step(checkpoint_dir):
    """The global step of the newest checkpoint under ``checkpoint_dir``, or None.

    An ordinary checkpoint counts, and so does a step that every shard
    ``shard-<r>-of-<P>/`` of one P holds (``gradaccum.ShardedAllReduce``'s
    layout). Read from the ``checkpoint`` state files, without TensorFlow.

    Args:
      checkpoint_dir: the job's checkpoint directory.

    Returns:
      An int, or None when there is no checkpoint.

    Example:
      >>> newest_checkpoint_step("/ckpt")
      6
    """
    candidates = set(_state_steps(checkpoint_dir))
    counts = {}
    for name in os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []:
        match = SHARD_PATTERN.match(name)
        if match:
            counts.setdefault(int(match.group(2)), []).append(_state_steps(os.path.join(checkpoint_dir, name)))
    for count, held in counts.items():
        if len(held) == count:
            candidates.update(set.intersection(*held))
    return max(candidates) if candidates else None


def check_prefix(prefix):
    """Refuses a checkpoint prefix that is not a file name: a path would reach into other directories.

    Args:
      prefix: what a job's ``Saver`` saves under, without ``-<step>``, such as ``"model.ckpt"``.

    Raises:
      TypeError: when ``prefix`` is not a str.
      ValueError: when ``prefix`` is empty, ``.`` or ``..``, or holds a directory.

    Example:
      >>> check_prefix("other_job/model.ckpt")
      Traceback (most recent call last):
      ValueError: `prefix` must be a file name without a directory, such as 'model.ckpt', got 'other_job/model.ckpt'
    """
    if not isinstance(prefix, str):
        raise TypeError("`prefix` must be a str (a file name such as 'model.ckpt'), got %r" % (prefix,))
    if not prefix or prefix in (".", "..") or "/" in prefix or os.sep in prefix:
        raise ValueError("`prefix` must be a file name without a directory, such as 'model.ckpt', got %r"
                         % (prefix,))


def _temporary_patterns(prefix):
    """The temporary file and sharded-directory names of saves under ``prefix``, as two regexes."""
    save = re.escape(prefix) + r"(?:-\d+)?"
    files = re.compile(r"^%s(?:\.(?:index|data-\d+-of-\d+)\.tempstate\d+|\.meta\.tmp[0-9a-f]{32})$" % save)
    return files, re.compile(r"^%s_temp(?:_[0-9a-f]{32})?$" % save)


def job_directories(checkpoint_dir):
    """The directories a job saves into: ``checkpoint_dir`` and its ``shard-<r>-of-<P>/`` directories.

    A symbolic link is not followed: it may lead to another job's files.

    Args:
      checkpoint_dir: the job's checkpoint directory (it may not exist).

    Returns:
      A list of paths, ``checkpoint_dir`` first; empty when it is not a directory.

    Example:
      >>> job_directories("/ckpt")
      ['/ckpt', '/ckpt/shard-0-of-2', '/ckpt/shard-1-of-2']
    """
    if not os.path.isdir(checkpoint_dir):
        return []
    shards = [os.path.join(checkpoint_dir, name) for _, _, name in list_shards(checkpoint_dir)]
    return [checkpoint_dir] + [path for path in shards if os.path.isdir(path) and not os.path.islink(path)]


def _sharded_save_files(path):
    """The files of ``path`` when it is a directory that holds only a sharded save's parts, else None."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    files = [os.path.join(path, name) for name in names]
    if all(_SHARDED_PART.match(name) for name in names) and all(os.path.isfile(file) for file in files):
        return files
    return None


def _temporaries_in(directory, prefix):
    """The paths to remove in ``directory``: temporary files, then each sharded save's parts and directory."""
    files, sharded = _temporary_patterns(prefix)
    try:
        names = sorted(os.listdir(directory))
    except OSError:  # Gone or unreadable meanwhile: nothing of ours to remove there.
        return []
    paths = []
    for name in names:
        path = os.path.join(directory, name)
        if (files.match(name) or _STATE_TEMPORARY.match(name)) and not os.path.isdir(path):
            paths.append(path)
        elif sharded.match(name):
            parts = _sharded_save_files(path)
            paths += [] if parts is None else parts + [path]  # The directory after its files.
    return paths


def remove_save_temporaries(checkpoint_dir, prefix="model.ckpt"):
    """Removes the temporary files that this job's interrupted TensorFlow saves left.

    Only TensorFlow's own temporary names for saves under ``prefix`` go (see
    the module docstring): ``<prefix>[-<step>].index.tempstate<digits>``,
    ``<prefix>[-<step>].data-00000-of-00001.tempstate<digits>``,
    ``<prefix>[-<step>].meta.tmp<32 hex>``, ``checkpoint.tmp<32 hex>``, and
    ``<prefix>[-<step>]_temp/`` or ``_temp_<32 hex>/`` directories that hold
    nothing but a sharded save's parts. They are looked for in
    ``checkpoint_dir`` and its ``shard-<r>-of-<P>/`` directories only; any
    other subdirectory (another job's) is not entered. Call it only when no
    task of the job runs: a save in progress owns such files. A file that
    cannot be removed stays.

    Args:
      checkpoint_dir: the job's checkpoint directory (it need not exist).
      prefix: the file name the job's ``Saver`` saves under in it, without
        ``-<step>`` (``"model.ckpt"`` for ``saver.save(sess,
        os.path.join(checkpoint_dir, "model.ckpt"), global_step=step)``).

    Returns:
      The sorted paths removed (a sharded save's parts and its directory).

    Raises:
      TypeError: when ``prefix`` is not a str.
      ValueError: when ``prefix`` is empty or holds a directory.

    Example:
      >>> remove_save_temporaries("/ckpt", "model.ckpt")
      ['/ckpt/model.ckpt-9.data-00000-of-00001.tempstate4878854028441751831']
    """
    check_prefix(prefix)
    removed = []
    for directory in job_directories(checkpoint_dir):
        removed += [path for path in _temporaries_in(directory, prefix) if _removed(path)]
    return sorted(removed)


def _removed(path):
    """Removes a file or an empty directory; False when it cannot (gone meanwhile): the job resumes anyway."""
    try:
        (os.rmdir if os.path.isdir(path) and not os.path.islink(path) else os.remove)(path)
    except OSError:
        return False
    return True


def describe_removed(checkpoint_dir, removed):
    """One line that says what :func:`remove_save_temporaries` removed, or None when it removed nothing.

    A sharded save's directory is named once, with the number of its parts.

    Args:
      checkpoint_dir: the directory that was cleaned.
      removed: the paths :func:`remove_save_temporaries` returned.

    Returns:
      A one-line string, or None.

    Example:
      >>> describe_removed("/ckpt", ["/ckpt/model.ckpt-9.index.tempstate12"])
      'removed 1 temporary file of interrupted saves from /ckpt: model.ckpt-9.index.tempstate12'
    """
    if not removed:
        return None
    directories = set(os.path.dirname(path) for path in removed) & set(removed)
    named = []
    for path in sorted(removed):
        if os.path.dirname(path) in directories:
            continue  # Counted with its directory.
        parts = sum(1 for other in removed if os.path.dirname(other) == path)
        relative = os.path.relpath(path, checkpoint_dir)
        named.append("%s/ (%d part file%s)" % (relative, parts, "" if parts == 1 else "s") if path in directories
                     else relative)
    count = len(removed) - len(directories)
    return "removed %d temporary file%s of interrupted saves from %s: %s" % (
        count, "" if count == 1 else "s", checkpoint_dir, ", ".join(named))


def other_prefixes(checkpoint_dir, prefix):
    """The checkpoint prefixes that the job's state files name, other than ``prefix``.

    A job that saves under another prefix than the launcher was told keeps
    its temporaries: the launcher says so instead of guessing.

    Args:
      checkpoint_dir: the job's checkpoint directory.
      prefix: the prefix the launcher cleans up for.

    Returns:
      A sorted list of file names, such as ``["ckpt"]``; empty when every
      checkpoint listed is ``prefix``'s, or there is none.

    Example:
      >>> other_prefixes("/ckpt", "model.ckpt")
      ['ckpt']
    """
    named = set()
    for directory in job_directories(checkpoint_dir):
        named.update(re.sub(r"-\d+$", "", os.path.basename(path)) for path in _state_paths(directory))
    return sorted(named - {prefix})
