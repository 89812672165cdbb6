#!/usr/bin/env bash
# Mesa 25.0.7's lavapipe from bookworm-backports, unpacked under .cache/mesa25 next to the system's Mesa 22.3,
# without touching the machine's apt sources or installed packages.
#
#   scripts/mesa25.sh fetch        download + unpack (idempotent; a no-op when already there)
#   scripts/mesa25.sh env          fetch if needed, then print the exports:  eval "$(scripts/mesa25.sh env)"
#   scripts/mesa25.sh run CMD...   fetch if needed, then run CMD with the Mesa 25 environment
#   scripts/mesa25.sh check        print driverInfo/apiVersion seen through .venv's `vulkan` package, with and
#                                  without the Mesa 25 environment
#
# How: an apt configuration of our own in .cache/apt-bpo/ (sources list = this machine's Debian mirror, as found
# in /etc/apt/sources.list{,.d}, with bookworm + bookworm-backports; own lists and cache), `apt-get download`,
# `dpkg -x`. Mesa 25.0.7 from backports is built against bookworm's LLVM 15 (libllvm15, which the system's
# mesa-vulkan-drivers already pulls in); what bookworm's versions don't satisfy is libdrm >= 2.4.121, so the
# backported libdrm2, libdrm-amdgpu1 (and its data package libdrm-common) come along.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
MESA25_VERSION=${MESA25_VERSION:-25.0.7-2~bpo12+1}
codename=bookworm
bpo=$codename-backports
# Packages unpacked into .cache/mesa25 (libdrm's from backports: Mesa 25 needs libdrm2/libdrm-amdgpu1 >= 2.4.121).
PKGS=("mesa-vulkan-drivers=$MESA25_VERSION" "libdrm2/$bpo" "libdrm-amdgpu1/$bpo" "libdrm-common/$bpo")
aptdir=$root/.cache/apt-bpo
dest=$root/.cache/mesa25
done_mark=$dest/.complete-$MESA25_VERSION
libdir=$dest/root/usr/lib/x86_64-linux-gnu
icd=$dest/lvp_icd.x86_64.json

# The URI of the first enabled "deb" source for $codename in the machine's own apt configuration.
system_mirror() {
  local f uri=""
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uri=$(awk -v want="$codename" '
      function flush() { if (deb && suite && enabled && uris != "" && out == "") { split(uris, u, " "); out = u[1] } }
      BEGIN { RS = ""; FS = "\n" }
      { deb = 0; suite = 0; enabled = 1; uris = ""
        for (i = 1; i <= NF; i++) {
          line = $i; if (line ~ /^#/) continue
          key = tolower(line); sub(/:.*/, "", key); val = line; sub(/^[^:]*:[ \t]*/, "", val)
          if (key == "types") { n = split(val, t, /[ \t]+/); for (j = 1; j <= n; j++) if (t[j] == "deb") deb = 1 }
          else if (key == "suites") { n = split(val, t, /[ \t]+/); for (j = 1; j <= n; j++) if (t[j] == want) suite = 1 }
          else if (key == "uris") uris = val
          else if (key == "enabled" && tolower(val) == "no") enabled = 0
        }
        flush() }
      END { if (out != "") print out }' "$f")
    [ -n "$uri" ] && { echo "$uri"; return; }
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    uri=$(awk -v want="$codename" '
      $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                    if ($(i + 1) == want) { print $i; exit } }' "$f")
    [ -n "$uri" ] && { echo "$uri"; return; }
  done
  echo "mesa25: found no '$codename' deb source in /etc/apt/sources.list{,.d}" >&2
  return 1
}

fetch() {
  [ -f "$done_mark" ] && return 0
  local t0=$SECONDS mirror keyring=""
  mirror=$(system_mirror)
  mirror=${mirror%/}
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] && keyring="[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
  echo "mesa25: fetching Mesa $MESA25_VERSION from $mirror $bpo into .cache/mesa25" >&2
  mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial" "$aptdir/sources.list.d" "$aptdir/debs"
  printf 'deb %s%s %s main\ndeb %s%s %s main\n' "$keyring" "$mirror" "$codename" "$keyring" "$mirror" "$bpo" \
    > "$aptdir/sources.list"
  cat > "$aptdir/apt.conf" <<EOF
Dir::Etc::SourceList "$aptdir/sources.list";
Dir::Etc::SourceParts "$aptdir/sources.list.d";
Dir::State::Lists "$aptdir/lists";
Dir::Cache "$aptdir/cache";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
Acquire::Languages "none";
APT::Sandbox::User "root";
EOF
  export APT_CONFIG=$aptdir/apt.conf
  apt-get update -qq
  # Cross-check against the installed system: which packages would apt have to install or upgrade?
  local extra
  extra=$(apt-get -s install --no-install-recommends "${PKGS[@]}" 2>/dev/null | awk '/^Inst /{print $2}' \
          | grep -vxE 'mesa-vulkan-drivers|libdrm2|libdrm-amdgpu1|libdrm-common' || true)
  [ -z "$extra" ] || echo "mesa25: note: apt would also install/upgrade: $(echo $extra) (not unpacked; checked with ldd below)" >&2
  rm -f "$aptdir"/debs/*.deb
  (cd "$aptdir/debs" && apt-get download -qq "${PKGS[@]}")
  rm -rf "$dest"
  mkdir -p "$dest/root"
  local deb
  for deb in "$aptdir"/debs/*.deb; do
    dpkg -x "$deb" "$dest/root"
    echo "mesa25:   $(basename "$deb")" >&2
  done
  local src=$dest/root/usr/share/vulkan/icd.d/lvp_icd.x86_64.json
  [ -f "$src" ] || src=$dest/root/usr/share/vulkan/icd.d/lvp_icd.json
  sed -E "s#(\"library_path\"[[:space:]]*:[[:space:]]*\")[^\"]*\"#\\1$libdir/libvulkan_lvp.so\"#" "$src" > "$icd"
  if LD_LIBRARY_PATH=$libdir ldd "$libdir/libvulkan_lvp.so" | grep 'not found' >&2; then
    echo "mesa25: libvulkan_lvp.so has unresolved libraries (is the system's mesa-vulkan-drivers installed?)" >&2
    return 1
  fi
  touch "$done_mark"
  echo "mesa25: ready in $((SECONDS - t0)) s" >&2
}

print_env() {
  local q
  q=$(printf '%q' "$libdir")
  echo "export VK_DRIVER_FILES=$(printf '%q' "$icd")"
  echo "export VK_ICD_FILENAMES=$(printf '%q' "$icd")"
  echo "export LD_LIBRARY_PATH=$q\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  # The system's implicit VK_LAYER_MESA_device_select is Mesa 22.3's; keep it out of Mesa 25's way.
  echo "export NODEVICE_SELECT=1"
}

check() {
  local py=$root/.venv/bin/python snippet
  snippet='
import vulkan as vk
app = vk.VkApplicationInfo(apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
inst = vk.vkCreateInstance(vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
for pd in vk.vkEnumeratePhysicalDevices(inst):
    drv = vk.VkPhysicalDeviceDriverProperties()
    p2 = vk.VkPhysicalDeviceProperties2(pNext=drv)
    vk.vkGetPhysicalDeviceProperties2(pd, p2)
    v = p2.properties.apiVersion
    print("  %s | %s | api %d.%d.%d" % (vk.ffi.string(p2.properties.deviceName).decode(), vk.ffi.string(drv.driverInfo).decode(),
          v >> 22, (v >> 12) & 0x3FF, v & 0xFFF))
vk.vkDestroyInstance(inst, None)'
  echo "system:"
  "$py" -c "$snippet"
  echo "Mesa 25 (scripts/mesa25.sh env):"
  (eval "$(print_env)"; "$py" -c "$snippet")
}

case "${1:-env}" in
  fetch) fetch ;;
  env) fetch; print_env ;;
  run) shift; fetch; eval "$(print_env)"; exec "$@" ;;
  check) fetch; check ;;
  *) echo "usage: $0 fetch|env|run CMD...|check" >&2; exit 2 ;;
esac
